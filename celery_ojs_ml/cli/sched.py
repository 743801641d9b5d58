"""Scheduler verbs and views: `scheduler`, `prioritize`, and the scheduler part of `status`.

Key decision: everything shown comes from the store (the pending set with the
leader's RFC 27 annotations, and the lock), so `status` and `explain` work
with the leader anywhere, and say the same words as the
`ojs-resource-waiting` event.
"""

from __future__ import annotations

import json
import logging
import signal
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from celery_ojs_ml.plugin import OJSML


def scheduler_part(plugin: OJSML) -> dict[str, Any]:
    """`{"leader": {id, since} | None, "jobs": {task_id: entry}}` from the store."""
    from celery_ojs_ml.store.pending import PendingBook

    book = PendingBook(plugin.store)
    jobs = {task_id: entry(record) for task_id, record in book.records().items()}
    raw = plugin.store.client.get(plugin.store.key("scheduler", "budgets"))
    budgets = json.loads(raw) if raw else {}
    part = {"leader": book.leader(), "jobs": jobs, "budgets": budgets}
    return {**part, "intake": intake_depth(plugin)}


def intake_depth(plugin: OJSML) -> dict[str, int] | None:
    """`{"waiting", "taken"}` messages in the intake queue (Redis brokers), else None."""
    from celery_ojs_ml.store import broker as redis_intake
    from celery_ojs_ml.wire.queues import intake_name

    try:
        with plugin.app.connection_for_read() as conn:
            channel = conn.default_channel
            if not redis_intake.supports(channel):
                return None
            name = intake_name(plugin.settings.store_prefix)
            waiting, taken = redis_intake.depth(channel, name)
    except Exception as exc:  # the rest of `status` is still worth showing
        logging.getLogger(__name__).debug("ojs-ml: no intake depth: %s", exc)
        return None
    return {"waiting": waiting, "taken": taken}


def entry(record: dict[str, Any]) -> dict[str, Any]:
    """One pending-set record as shown by `status` and `explain` (RFC 27 annotations)."""
    meta = record.get("meta") or {}
    note = record.get("annotation") or {}
    # A job delivered ahead of capacity (`ojs_ml_prefetch`) is assigned but still waits,
    # at its worker's gate: it is shown waiting, with the reason and estimate of the
    # pass that sent it there.
    ahead = record.get("state") == "assigned" and bool(note.get("ahead"))
    assigned = record.get("state") == "assigned" and not ahead
    reason = note.get("reason_pending") or record.get("reason")
    return {
        "state": "assigned" if assigned else "pending",
        "reason_pending": None if assigned else (reason or "waiting for the scheduler's pass"),
        "t_estimate": None if assigned else note.get("t_estimate"),
        "worker": record.get("worker") if assigned or ahead else note.get("worker"),
        "ahead": ahead,
        "task": meta.get("task"),
        "queue": meta.get("queue"),
        "band": meta.get("band"),
        "priority": int(record.get("priority", meta.get("priority", 0)) or 0),
        "since": meta.get("submitted_at"),
    }


def render(part: dict[str, Any], now: float) -> str:
    """The scheduler block of `status`."""
    leader = part.get("leader")
    if leader:
        head = f"scheduler: {leader.get('id')} leads (for {_ago(leader.get('since'), now)})"
    else:
        head = "scheduler: no leader (start a worker, or `celery -A proj ojs-ml scheduler`)"
    jobs = part.get("jobs") or {}
    lines = [head, *_intake_lines(part.get("intake") or {}, bool(leader))]
    lines += [*_budget_lines(part.get("budgets") or {}), f"scheduled jobs: {len(jobs)}"]
    for task_id, job in sorted(jobs.items(), key=lambda kv: kv[1].get("since") or 0):
        if job["state"] == "assigned":
            lines.append(f"  {task_id}  assigned to {job['worker']} ({job['task']})")
            continue
        start = job.get("t_estimate")
        when = f"starts in ~{max(0.0, start - now):.0f} s" if start else "start unknown"
        where = f", reserved on {job['worker']}" if job.get("worker") else ""
        lines.append(f"  {task_id}  {job['task']}, band {job['band']}, {when}{where}")
        lines.append(f"      reason: {job['reason_pending']}")
    return "\n".join(lines)


def _intake_lines(intake: dict[str, Any], leading: bool) -> list[str]:
    """Jobs published but not admitted yet; none shown when the intake is empty."""
    waiting, taken = int(intake.get("waiting") or 0), int(intake.get("taken") or 0)
    if not waiting and not taken:
        return []
    line = f"intake: {waiting} published, not yet admitted"
    if taken:
        line += f"; {taken} taken by a leader, admitted first by the next one"
    return [line + ("" if leading else " (they wait for a leader)")]


def _budget_lines(budgets: dict[str, Any]) -> list[str]:
    """One line per budgeted queue (OJS ML §10.3): use against each limit."""
    lines = []
    for queue, b in sorted(budgets.items()):
        parts = []
        if b.get("max_total_gpus") is not None:
            parts.append(f"{b['gpus']}/{b['max_total_gpus']} GPUs (max_total_gpus)")
        if b.get("max_concurrent_gpu_jobs") is not None:
            parts.append(f"{b['jobs']}/{b['max_concurrent_gpu_jobs']} GPU jobs")
        lines.append(f"budget {queue}: {', '.join(parts)}")
    return lines


def _ago(since: Any, now: float) -> str:
    if not isinstance(since, int | float):
        return "?"
    return f"{now - since:.0f} s"


@click.command()
@click.option("-A", "--app", "app_name", metavar="MODULE[:ATTR]", help="The Celery app.")
@click.option("--name", default=None, help="Candidate name in the lock (default: host:random).")
@click.pass_context
def scheduler(ctx: click.Context, app_name: str | None, name: str | None) -> None:
    """Run the fleet scheduler as its own process (it leads when elected)."""
    from celery_ojs_ml.cli.app import load_plugin
    from celery_ojs_ml.leader.loop import FleetScheduler

    plugin = load_plugin(ctx, app_name)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    loop = FleetScheduler(plugin.app, candidate=name)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: loop.stop())
    click.echo(f"ojs-ml scheduler {loop.candidate}: standing for the lock", err=True)
    loop.run()


@click.command()
@click.argument("task_id")
@click.argument("priority", type=int)
@click.option("-A", "--app", "app_name", metavar="MODULE[:ATTR]", help="The Celery app.")
@click.pass_context
def prioritize(ctx: click.Context, task_id: str, priority: int, app_name: str | None) -> None:
    """Give a waiting job a new priority (RFC 27 prioritize); exit 1 if it is not waiting."""
    from celery_ojs_ml.cli.app import load_plugin

    plugin = load_plugin(ctx, app_name)
    if not plugin.prioritize(task_id, priority):
        click.echo(f"{task_id} is not waiting in the pending set", err=True)
        raise SystemExit(1)
    click.echo(f"{task_id}: priority {priority}")
