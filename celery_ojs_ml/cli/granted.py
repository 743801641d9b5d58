"""`status` and `explain` for grants (`ojs_ml_grants`, docs/scheduling.md "Grants").

A job published under a grant is not in the pending set: it waits on its holder's own
queue, a Redis list. `status` lists every grant with how many jobs are queued on its
holder; `explain` finds such a job there (reading the head of each holder's queue, as it
does for the requirement-class queues) and says so: `pending`, delivered ahead to the
holder (as a prefetched job is), with how many messages go before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_ojs_ml.plugin import OJSML


def _holder_queues(plugin: OJSML) -> dict[str, tuple[str, str]]:
    """holder's own queue -> (grant field, holder), for every grant in the store."""
    from celery_ojs_ml.wire.queues import worker_queue_name

    prefix = plugin.settings.store_prefix
    return {
        worker_queue_name(prefix, worker): (field, worker)
        for field, (worker, _) in plugin.grant_book.all().items()
    }


def grants_part(plugin: OJSML) -> list[dict[str, Any]]:
    """Every grant: its field (queue|band|class), holder and jobs queued on the holder."""
    from celery_ojs_ml.store import broker as redis_intake

    holders = _holder_queues(plugin)
    if not holders:
        return []
    with plugin.app.connection_for_read() as conn:
        channel = conn.default_channel
        counts = redis_intake.backlog(channel.client, channel, list(holders))
    return [
        {"grant": field, "worker": worker, "queued": counts.get(queue, 0)}
        for queue, (field, worker) in sorted(holders.items())
    ]


def render_grants(part: list[dict[str, Any]]) -> str:
    """The human lines of `grants_part` (empty when there is no grant)."""
    if not part:
        return ""
    lines = ["grants (throughput mode: jobs of these classes go straight to the worker):"]
    for g in part:
        lines.append(f"  {g['grant']} -> {g['worker']}, {g['queued']} job(s) queued there")
    return "\n".join(lines)


def find_granted(plugin: OJSML, task_id: str) -> dict[str, Any] | None:
    """A job published under a grant and still queued on its holder; None if not found
    (one held at the holder's gate shows in its heartbeat: `fleet_view.locate`)."""
    from celery_ojs_ml.store.grants import locate_granted

    found = locate_granted(plugin, task_id)
    if found is None or found[2] < 0:
        return None
    worker, field, before = found
    return _queued(task_id, worker, field, before, plugin)


def _queued(task_id: str, worker: str, field: str, before: int, plugin: OJSML) -> dict[str, Any]:
    """`explain` of a job queued on its grant's holder: delivered ahead, as a prefetched
    job is; it starts there or goes back to the scheduler within `ojs_ml_grant_wait_s`."""
    wait = plugin.settings.grant_wait_s
    return {
        "task_id": task_id,
        "state": "pending",
        "worker": worker,
        "reason_pending": f"delivered ahead to {worker} under its class's grant, behind "
        f"{before} job(s) queued there; it starts there as they end, or goes back to the "
        f"scheduler once it has waited {wait:g} s (ojs_ml_grant_wait_s)",
        "t_estimate": None,
        "grant": field,
        "ahead": before + 1,
        "queued_before": before,
    }
