"""The ledger: capacity the leader assigned that a worker's last heartbeat cannot show yet.

Key decision: workers report, the scheduler decides. A worker's free capacity
is what its gate last advertised; capacity assigned since (a message in
flight, or a job started after that heartbeat) is taken off by the ledger
until a heartbeat newer than the assignment's start shows it. The gate stays
the safety net: an assignment that no longer fits is given back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_ojs_ml.allocator.model import Demand
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.store.pending import ASSIGNED, PENDING

StartedAt = Callable[[list[str]], Mapping[str, float | None]]
"""Task ids -> when their gate started them (None: not started, or gone)."""


@dataclass
class _Settled:
    worker: str
    demand: Demand
    since: float
    """When the scheduler last saw it still assigned (its heartbeat must be newer)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """The job's own labels (§7.3): other jobs' anti-affinity sees them before it runs."""
    share: MLRequirements | None = None
    """A GPU share's requirements: its milli-GPU are taken off the worker's devices."""


class Ledger:
    """Assignments whose capacity the worker's last heartbeat does not show yet."""

    def __init__(self) -> None:
        self.entries: dict[str, _Settled] = {}
        self.counted: set[str] = set()
        """Entries the last `used` counted (their capacity is not in a heartbeat yet)."""

    def assigned(
        self,
        task_id: str,
        worker: str,
        demand: Demand,
        now: float,
        labels: Mapping[str, str] | None = None,
        share: MLRequirements | None = None,
    ) -> None:
        """The scheduler just assigned `task_id` to `worker` (`share`: a GPU share job)."""
        self.entries[task_id] = _Settled(worker, demand, now, dict(labels or {}), share)

    def shares(self) -> dict[str, list[MLRequirements]]:
        """Each worker's in-flight GPU shares that its heartbeat does not show (after `used`)."""
        out: dict[str, list[MLRequirements]] = {}
        for task_id in self.counted:
            entry = self.entries.get(task_id)
            if entry is not None and entry.share is not None:
                out.setdefault(entry.worker, []).append(entry.share)
        return out

    def jobs(self) -> dict[str, int]:
        """Each worker's in-flight jobs that its heartbeat does not show (after `used`):
        each will take one of its pool processes."""
        out: dict[str, int] = {}
        for task_id in self.counted:
            entry = self.entries.get(task_id)
            if entry is not None:
                out[entry.worker] = out.get(entry.worker, 0) + 1
        return out

    def labels(self) -> dict[str, list[Mapping[str, str]]]:
        """Each worker's in-flight jobs' labels (call after `used`, which prunes)."""
        out: dict[str, list[Mapping[str, str]]] = {}
        for entry in self.entries.values():
            if entry.labels:
                out.setdefault(entry.worker, []).append(entry.labels)
        return out

    def used(
        self,
        records: Mapping[str, Mapping[str, Any]],
        beats: Mapping[str, float],
        allocated: Mapping[str, frozenset[str]],
        now: float,
        started_at: StartedAt | None = None,
    ) -> dict[str, Demand]:
        """Capacity to take off each worker's advertised free capacity now.

        An entry still assigned counts (refreshing `since`). One that left the
        assigned state (started) counts until its worker reports it allocated,
        or until a heartbeat newer than its start (`started_at`, the gate's
        clock, as the heartbeat's): the job ended before that heartbeat. A
        heartbeat newer than the last pass that saw it assigned is not enough:
        the gate may start it after that heartbeat, which then still shows its
        GPUs free (the leader assigned them twice and the gate gave one back).
        Without `started_at` (or a start time), that last sighting is used.
        """
        left = self._refresh(records, allocated, now)
        starts = started_at(left) if left and started_at is not None else {}
        used: dict[str, Demand] = {}
        self.counted = set()
        for task_id in list(self.entries):
            entry = self.entries[task_id]
            shown = task_id in allocated.get(entry.worker, frozenset())
            record = records.get(task_id)
            still = record is not None and record.get("state") == ASSIGNED
            since = starts.get(task_id) or entry.since
            if not still and (shown or beats.get(entry.worker, 0.0) > since):
                del self.entries[task_id]
                continue
            if shown:
                continue
            self.counted.add(task_id)
            used[entry.worker] = used.get(entry.worker, Demand()).plus(entry.demand)
        return used

    def _refresh(
        self,
        records: Mapping[str, Mapping[str, Any]],
        allocated: Mapping[str, frozenset[str]],
        now: float,
    ) -> list[str]:
        """Refresh the entries still assigned, drop those given or taken back; returns
        those that left the assigned state and no heartbeat shows allocated yet."""
        left: list[str] = []
        for task_id in list(self.entries):
            entry = self.entries[task_id]
            record = records.get(task_id)
            if record is not None and record.get("state") == ASSIGNED:
                if record.get("worker") == entry.worker:
                    entry.since = now
            elif record is not None and record.get("state") == PENDING:
                del self.entries[task_id]  # given or taken back
            elif task_id not in allocated.get(entry.worker, frozenset()):
                left.append(task_id)
        return left
