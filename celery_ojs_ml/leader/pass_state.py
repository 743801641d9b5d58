"""What one scheduling pass reads and decides, in one object made afresh per pass.

Key decision: as Kubernetes' scheduler keeps a `CycleState` per cycle, the
pass's reads (pending records, live workers, leases), the core's inputs and
its decision live here and are handed to each collaborator, instead of
attributes on the leader that outlive the pass. What lasts from pass to pass
(the ledger, the window, grants, jobs held ahead) stays with its collaborator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery_ojs_ml.scheduler import Decision, PendingJob, WorkerState


@dataclass(slots=True)
class PassState:
    """One pass's reads, inputs and decision (see module doc)."""

    now: float
    """Wall-clock time of the pass (the stores' and the core's clock)."""
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every waiting or assigned job's pending record, in admission order."""
    reserving: bool = False
    """Whether any reservation record exists."""
    live: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The live workers' advertisements."""
    leases: list[dict[str, Any]] = field(default_factory=list)
    """The running jobs' leases."""
    fleet: list[WorkerState] = field(default_factory=list)
    """The core's view of the live workers."""
    jobs: dict[str, PendingJob] = field(default_factory=dict)
    """The waiting jobs the pass decides, by task id."""
    inflight: list[tuple[str, int]] = field(default_factory=list)
    """(queue, GPUs) assigned and not yet running (budgets, fair share)."""
    usage: dict[str, float] | None = None
    """Each queue's decayed mean of GPUs held (`leader.fair_usage`); None: no half-life."""
    decision: Decision = field(default_factory=Decision)
    rendezvous: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The `ojs_rendezvous` header of each gang rank the pass assigns."""
    blocked: frozenset[str] | None = frozenset()
    """Workers a job left waiting could use (`scheduler.grants.contested`)."""
    quiet: bool = False
    """The reads found nothing waiting and read the fleet exactly (the fast lane's cue)."""
    dirty: bool = False
    """Something changed that the pass did not decide on: the next step passes at once."""
