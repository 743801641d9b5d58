"""Budget holds: the leader's assignments counted against a queue's GPU budget (§10.3)
or its fair share until their leases show.

Key decision: an assignment holds its queue's budget from the moment it is
made, not from its start: counted only once running, a burst of assignments
in one pass could all fit under a budget that they overrun together.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from celery_ojs_ml.scheduler import PendingJob, Policy
from celery_ojs_ml.store.pending import ASSIGNED, PENDING

from .fleet_view import allocated_ids


@dataclass
class BudgetHold:
    """A job this leader assigned, counted against its queue's budget until its lease shows."""

    queue: str
    gpus: int
    worker: str


class StartTimes(Protocol):
    """`PendingBook.started_at`."""

    def started_at(self, task_ids: list[str]) -> Mapping[str, float | None]: ...


class BudgetHolds:
    """This leader's assignments of budgeted queues or, with fair-share weights, of every
    queue, until their leases show (`budget_inflight`)."""

    def __init__(self, policy: Policy) -> None:
        self.budgeted = {queue for queue, _ in policy.budgets}
        self.weighted = bool(policy.weights)
        self.holds: dict[str, BudgetHold] = {}

    def add(self, task_id: str, job: PendingJob, worker: str) -> None:
        """The leader just assigned `job` to `worker`."""
        if job.queue in self.budgeted or self.weighted:
            self.holds[task_id] = BudgetHold(job.queue, int(job.req.ext_ml_gpu_count or 0), worker)

    def inflight(
        self,
        records: Mapping[str, Mapping[str, Any]],
        leases: list[dict[str, Any]],
        live: Mapping[str, Mapping[str, Any]],
        book: StartTimes,
        ahead: Collection[str],
    ) -> list[tuple[str, int]]:
        """Budget use of assignments not yet running (§10.3); jobs waiting ahead at a
        gate (`ahead`) hold nothing yet."""
        gone = [t for t in self.holds if t not in records]
        started = book.started_at(gone) if gone else {}
        return budget_inflight(self.holds, records, leases, live, started, ahead)


def budget_inflight(
    holds: dict[str, BudgetHold],
    records: Mapping[str, Mapping[str, Any]],
    leases: list[dict[str, Any]],
    live: Mapping[str, Mapping[str, Any]],
    started: Mapping[str, float | None],
    ahead: Collection[str] = (),
) -> list[tuple[str, int]]:
    """(queue, GPUs) of the assigned jobs that hold budget and have no lease yet (§10.3).

    `holds` are this leader's assignments; `started` gives, for those no longer
    in the pending set, when their gate started them (None: not started, or
    gone). A hold is counted until its lease shows (the lease is counted as a
    running job), and dropped once the job is back to pending, gone, or ended:
    started, no lease, and a heartbeat of its worker newer than its start that
    does not show it allocated. Assigned records of an earlier leader are
    counted from the pending set. `holds` is pruned in place. A hold in `ahead` (a job
    this leader delivered ahead of capacity, `ojs_ml_prefetch`) is not counted while
    its record is still assigned: it waits at its worker's gate and holds no GPU yet.
    """
    running = {str(lease.get("task_id")) for lease in leases}
    out = _earlier(holds, records, running)
    allocated = allocated_ids(live)
    for task_id, hold in list(holds.items()):
        found = records.get(task_id)
        if task_id in running or (found is not None and found.get("state") == PENDING):
            del holds[task_id]
            continue
        if found is not None and task_id in ahead and found.get("state") == ASSIGNED:
            continue  # waiting at the gate; counted from its start
        if found is None and _ended(task_id, hold, started, live, allocated):
            del holds[task_id]  # gone, or it ended before its lease was written
            continue
        out.append((hold.queue, hold.gpus))
    return out


def _earlier(
    holds: Mapping[str, BudgetHold], records: Mapping[str, Mapping[str, Any]], running: set[str]
) -> list[tuple[str, int]]:
    """(queue, GPUs) of the assigned records this leader holds nothing for (an earlier
    leader's assignments), not running yet."""
    out: list[tuple[str, int]] = []
    for task_id, record in records.items():
        if record.get("state") == ASSIGNED and task_id not in holds and task_id not in running:
            meta = record.get("meta") or {}
            out.append((str(meta.get("queue") or "celery"), int(meta.get("gpus") or 0)))
    return out


def _ended(
    task_id: str,
    hold: BudgetHold,
    started: Mapping[str, float | None],
    live: Mapping[str, Mapping[str, Any]],
    allocated: Mapping[str, frozenset[str]],
) -> bool:
    """Whether a hold no longer in the pending set is over: never started (gone), or a
    heartbeat of its worker newer than its start does not show it allocated."""
    at = started.get(task_id)
    beat = float((live.get(hold.worker) or {}).get("ts") or 0.0)
    shown = task_id in allocated.get(hold.worker, frozenset())
    return at is None or (beat > at and not shown)
