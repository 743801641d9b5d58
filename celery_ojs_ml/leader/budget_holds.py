"""Budget holds: the leader's assignments counted against a queue's GPU budget (§10.3)
or its fair share until their leases show.

Split out of `fleet_view` to keep modules small.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from celery_ojs_ml.leader.fleet_view import allocated_ids
from celery_ojs_ml.store.pending import ASSIGNED, PENDING


@dataclass
class BudgetHold:
    """A job this leader assigned, counted against its queue's budget until its lease shows."""

    queue: str
    gpus: int
    worker: str


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
    allocated = allocated_ids(live)
    out: list[tuple[str, int]] = []
    for task_id, record in records.items():
        if record.get("state") == ASSIGNED and task_id not in holds and task_id not in running:
            meta = record.get("meta") or {}
            out.append((str(meta.get("queue") or "celery"), int(meta.get("gpus") or 0)))
    for task_id, hold in list(holds.items()):
        found = records.get(task_id)
        if task_id in running or (found is not None and found.get("state") == PENDING):
            del holds[task_id]
            continue
        if found is not None and task_id in ahead and found.get("state") == ASSIGNED:
            continue  # waiting at the gate; counted from its start
        if found is None:
            at = started.get(task_id)
            beat = float((live.get(hold.worker) or {}).get("ts") or 0.0)
            shown = task_id in allocated.get(hold.worker, frozenset())
            if at is None or (beat > at and not shown):
                del holds[task_id]  # gone, or it ended before its lease was written
                continue
        out.append((hold.queue, hold.gpus))
    return out
