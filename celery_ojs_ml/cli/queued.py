"""Jobs that wait on a broker queue instead of in the pending set, for `status` and `explain`.

A job published under a grant waits on its holder's own queue (`ojs_ml_grants`,
docs/scheduling.md "Grants"): `status` lists every grant with how many jobs are queued
on its holder, and `explain` finds such a job there and says so: `pending`, delivered
ahead to the holder (as a prefetched job is), with how many messages go before it.
`explain` also finds jobs left in the per-class queues of an earlier version (state
`queued`), judged against the live workers (`live_fleet`, the router's own view).
Key decision: only the head of each queue is read (`_SCAN_LIMIT` messages).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from celery_ojs_ml.capabilities import Capabilities, parse_capabilities
from celery_ojs_ml.matching.filters import FreeCapacity
from celery_ojs_ml.spec.resources import is_requirement_key

if TYPE_CHECKING:  # the offline verbs share this package and should not pay for importing Celery
    from celery_ojs_ml.plugin import OJSML

_FREE_FIELDS = {"gpus": "gpu_count", "cpu_cores": "cpu_cores", "memory_gb": "memory_gb"}


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


def live_fleet(
    plugin: OJSML, live: dict[str, dict[str, Any]] | None = None
) -> tuple[dict[str, Capabilities], dict[str, FreeCapacity]]:
    """The store's live workers (the router's own view) with their advertised free capacity.

    `live` is `OJSStore.live_workers()` when the caller has already read it.
    """
    fleet: dict[str, Capabilities] = {}
    free: dict[str, FreeCapacity] = {}
    live = plugin.store.live_workers() if live is None else live
    for name, entry in sorted(live.items()):
        fleet[name] = parse_capabilities(entry["capabilities"], worker_id=name)
        counts = entry.get("free", {}).get("free", {})
        free[name] = FreeCapacity(
            **{field: counts.get(key) for field, key in _FREE_FIELDS.items()},
            tpu_chips=counts.get("tpu_chip_count") or None,
        )
    return fleet, free


_SCAN_LIMIT = 10_000
"""Messages read from the head of each class queue when looking for a task id."""


def find_queued(plugin: OJSML, task_id: str) -> dict[str, Any] | None:
    """A job still in a requirement-class queue of a Redis broker; None when not found.

    Reads the head (the next `_SCAN_LIMIT` messages to be delivered) of every
    registered (class, logical queue, band) queue, and judges the job against
    the live workers that consume its logical queue, with their advertised
    free capacity. Raises `LookupError` when the broker is not Redis (its
    queued messages cannot be listed).
    """
    from celery_ojs_ml.matching import rank
    from celery_ojs_ml.spec.normalize import normalize
    from celery_ojs_ml.store.registry import class_routes
    from celery_ojs_ml.wire.queues import PRIORITY_SUFFIXES, queue_name

    with plugin.app.connection_for_read() as conn:
        if conn.transport.driver_type != "redis":
            raise LookupError(f"the broker is {conn.transport.driver_type}, not Redis")
        client = conn.default_channel.client
        for cid, entry in plugin.store.classes().items():
            for logical, band in class_routes(entry):
                queue = queue_name(logical, cid, band)
                for key in (queue + suffix for suffix in PRIORITY_SUFFIXES):
                    items = client.lrange(key, -_SCAN_LIMIT, -1)  # BRPOP takes from the right
                    for index, raw in enumerate(items):
                        try:
                            headers = json.loads(raw).get("headers") or {}
                        except (ValueError, AttributeError):
                            continue
                        if headers.get("id") != task_id:
                            continue
                        attrs = {k: v for k, v in headers.items() if is_requirement_key(k)}
                        req = normalize(attrs).requirements
                        live = plugin.store.live_workers()
                        workers, free = live_fleet(plugin, live)
                        mine = {n: w for n, w in workers.items() if _consumes(live[n], logical)}
                        return {
                            "task_id": task_id,
                            "state": "queued",
                            "queue": queue,
                            "logical_queue": logical,
                            "band": band,
                            "class_id": cid,
                            "ahead": len(items) - 1 - index,
                            "workers": [
                                {"worker": n, **r.as_dict()} for n, r in rank(req, mine, free)
                            ],
                            "not_consuming": sorted(n for n in workers if n not in mine),
                        }
    return None


def _consumes(entry: dict[str, Any], logical: str) -> bool:
    """Whether a live worker consumes `logical` (True when it does not advertise its queues)."""
    queues = (entry.get("info") or {}).get("queues")
    return queues is None or logical in queues


def render_queued(found: dict[str, Any]) -> str:
    lines = [
        f"{found['task_id']} is queued in {found['queue']} (band {found['band']}), "
        f"{found['ahead']} message(s) ahead of it"
    ]
    rows = found["workers"]
    fits = [r["worker"] for r in rows if r["verdict"] == "FITS"]
    eligible = [r for r in rows if r["verdict"] != "NEVER"]
    if fits:
        lines.append(f"    {', '.join(fits)} can start it now; it should start within seconds")
    elif eligible:
        busy = "; ".join(
            f"{r['worker']}: " + "; ".join(x["message"] for x in r["reasons"]) for r in eligible
        )
        lines.append(f"    it waits for capacity on an eligible worker: {busy}")
    else:
        lines.append(
            f"    no live worker that consumes {found['logical_queue']!r} can run it "
            "(see `explain FILE` for each worker's reasons)"
        )
    if found["not_consuming"]:
        lines.append(
            f"    not consuming {found['logical_queue']!r}: {', '.join(found['not_consuming'])}"
        )
    return "\n".join(lines)
