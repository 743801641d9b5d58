"""Where each demo job is now, and whether the demo's outcome is right.

A job's state comes from two places: the result backend (STARTED carries the
node and devices the task reported, SUCCESS its final record) and the plugin's
store (the pending record of a job no live worker can run, OJS §7.2, and the
held snapshots of jobs a worker's gate holds until capacity frees).

Key decision: `judge` checks the outcome against the fleet's capabilities and
the tasks' own records, not against the plugin's internal state: every
runnable job finished on a node that satisfies every hard constraint, each
chain step started after the step before it finished, no GPU index ran two jobs
at once on a node, and every job no node can run waits with a reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from celery import Celery

from celery_ojs_ml.demo.jobs import DemoJob
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore

DONE, FAILED, RUNNING, HELD, QUEUED, WAITING, BLOCKED, ASSIGNED = (
    "done",
    "failed",
    "running",
    "held",
    "queued",
    "waiting",
    "after previous step",
    "assigned",
)


@dataclass(frozen=True)
class Row:
    """One job's observed state."""

    job: DemoJob
    state: str
    node: str | None = None
    devices: tuple[int, ...] = ()
    reason: str = ""
    started: float | None = None
    finished: float | None = None
    cuda_visible_devices: str | None = None
    """What the task saw; set per task only under prefork (pinning)."""
    estimate: float | None = None
    """The scheduler's start estimate (RFC 27 `t_estimate`) while the job waits."""

    @property
    def settled(self) -> bool:
        """Finished, failed, or waiting for a node that does not exist."""
        return self.state in (DONE, FAILED) or (self.state == WAITING and not self.job.runnable)

    def as_dict(self) -> dict[str, Any]:
        """JSON form for `demo --report`."""
        return {
            "task_id": self.job.task_id,
            "label": self.job.label,
            "task": self.job.task,
            "band": self.job.band,
            "routed": self.job.routed,
            "eligible": sorted(self.job.eligible),
            "note": self.job.note,
            "after": self.job.after,
            "state": self.state,
            "node": self.node,
            "devices": list(self.devices),
            "reason": self.reason,
            "started": self.started,
            "finished": self.finished,
            "cuda_visible_devices": self.cuda_visible_devices,
            "t_estimate": self.estimate,
        }


def observe(app: Celery, store: OJSStore, jobs: Iterable[DemoJob]) -> list[Row]:
    """Every job's current state."""
    pending = store.pending()
    scheduled = PendingBook(store).records()
    held = {
        str(item.get("task_id")): (worker, str(item.get("reason", "")))
        for worker, items in store.held().items()
        for item in items
    }
    rows: list[Row] = []
    seen: dict[str, Row] = {}
    for job in jobs:
        row = _scheduled(job, scheduled) or _row(app, job, pending, held, seen)
        seen[job.task_id] = row
        rows.append(row)
    return rows


def _row(
    app: Celery,
    job: DemoJob,
    pending: dict[str, dict[str, Any]],
    held: dict[str, tuple[str, str]],
    seen: dict[str, Row],
) -> Row:
    result = app.AsyncResult(job.task_id)
    state, info = result.state, result.info
    if state == "SUCCESS" and isinstance(info, dict):
        return _ran(job, DONE, info)
    if state == "STARTED" and isinstance(info, dict):
        return _ran(job, RUNNING, info)
    if state == "FAILURE":
        return Row(job, FAILED, reason=f"{type(info).__name__}: {info}")
    if job.task_id in pending:
        return Row(job, WAITING, reason=str(pending[job.task_id].get("reason", "")))
    if job.task_id in held:
        worker, reason = held[job.task_id]
        return Row(job, HELD, node=worker, reason=reason)
    before = seen.get(job.after) if job.after else None
    if before is not None and before.state != DONE:
        return Row(job, BLOCKED)
    return Row(job, QUEUED)


def _scheduled(job: DemoJob, records: dict[str, dict[str, Any]]) -> Row | None:
    """A job in the fleet scheduler's pending set: waiting (reason, estimate) or assigned."""
    record = records.get(job.task_id)
    if record is None:
        return None
    if record.get("state") == "assigned":
        return Row(job, ASSIGNED, node=record.get("worker"))
    note = record.get("annotation") or {}
    reason = note.get("reason_pending") or record.get("reason") or "waiting for the scheduler"
    estimate = note.get("t_estimate")
    return Row(job, WAITING, reason=str(reason), estimate=estimate if estimate else None)


def _ran(job: DemoJob, state: str, info: dict[str, Any]) -> Row:
    return Row(
        job,
        state,
        node=info.get("node"),
        devices=tuple(int(d) for d in info.get("devices") or ()),
        started=info.get("started"),
        finished=info.get("finished"),
        cuda_visible_devices=info.get("cuda_visible_devices"),
    )


def settled(rows: Iterable[Row]) -> bool:
    """Whether nothing will change any more."""
    return all(r.settled for r in rows)


def judge(rows: list[Row]) -> list[str]:
    """Everything wrong with the outcome, in words; empty when the demo succeeded."""
    problems = [p for r in rows if (p := _problem(r))]
    by_id = {r.job.task_id: r for r in rows}
    for row in rows:
        before = by_id.get(row.job.after) if row.job.after else None
        if before is None or row.state != DONE or before.state != DONE:
            continue
        if (row.started or 0.0) < (before.finished or 0.0):
            problems.append(f"{row.job.label} started before {before.job.label} finished")
    return problems + _device_overlaps(rows)


def _problem(row: Row) -> str | None:
    job = row.job
    if not job.runnable:
        if row.state != WAITING or not row.reason:
            return f"{job.label} ({job.task_id}) no node can run it, yet it is {row.state}"
        return None
    if row.state != DONE:
        detail = f": {row.reason}" if row.reason else ""
        return f"{job.label} ({job.task_id}) did not finish; it is {row.state}{detail}"
    if row.node not in job.eligible:
        eligible = ", ".join(sorted(job.eligible))
        return f"{job.label} ran on {row.node}, which cannot run it (eligible: {eligible})"
    return None


def _device_overlaps(rows: list[Row]) -> list[str]:
    ran = [
        (r, r.started, r.finished)
        for r in rows
        if r.state == DONE and r.devices and r.started is not None and r.finished is not None
    ]
    problems = []
    for i, (a, a_start, a_end) in enumerate(ran):
        for b, b_start, b_end in ran[i + 1 :]:
            shared = set(a.devices) & set(b.devices)
            overlap = a_start < b_end and b_start < a_end
            if a.node == b.node and shared and overlap:
                problems.append(
                    f"{a.job.label} and {b.job.label} both ran on {a.node} GPU(s) "
                    f"{sorted(shared)} at the same time"
                )
    return problems
