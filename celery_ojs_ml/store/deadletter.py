"""Dead-lettered ML jobs (OJS ML §14.2): terminal failures that keep their checkpoint.

Key decision: a dead-letter record holds everything needed to run the job
again (task name, arguments, canonical headers) plus the last committed
checkpoint, so `celery ojs-ml dead --retry TASK_ID` resumes the job where it
stopped instead of starting over.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from celery import Celery

from celery_ojs_ml.store.checkpoints import last_checkpoint_of
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.headers import plugin_publish
from celery_ojs_ml.wire.records import republish_headers

log = logging.getLogger(__name__)
__all__ = ["dead_jobs", "dead_letter", "last_checkpoint_of", "republish_request", "retry_dead"]


def republish_request(
    app: Celery, store: OJSStore, req: Any, **counters: int
) -> dict[str, Any] | None:
    """Re-publish a worker's request under the same id and retries, with its last committed
    checkpoint and updated counters (`ojs_preemptions`, `ojs_crashes`); returns that
    checkpoint (None: none committed)."""
    headers = req.request_dict
    checkpoint = last_checkpoint_of(store, req.id)
    with plugin_publish():  # the plugin's own headers are kept
        app.send_task(
            req.name,
            args=list(req.args),
            kwargs=dict(req.kwargs),
            task_id=req.id,
            retries=int(headers.get("retries") or 0),
            headers=republish_headers(headers, ojs_last_checkpoint=checkpoint, **counters),
        )
    return checkpoint


def dead_letter(store: OJSStore, job: dict[str, Any], reason: str) -> dict[str, Any]:
    """Record a job as dead with its reason and last checkpoint; returns the record."""
    record = {
        "task_id": job["task_id"],
        "name": job["name"],
        "args": job.get("args", []),
        "kwargs": job.get("kwargs", {}),
        "headers": job.get("headers", {}),
        "retries": job.get("retries", 0),
        "reason": reason,
        "last_checkpoint": last_checkpoint_of(store, job["task_id"]),
        "at": store._clock(),
    }
    with store.client.pipeline(transaction=True) as pipe:
        pipe.set(store.key("dead", job["task_id"]), json.dumps(record))
        pipe.zadd(store.key("dead-index"), {job["task_id"]: record["at"]})
        pipe.execute()
    log.error("ojs-ml: %s[%s] dead-lettered: %s", job["name"], job["task_id"], reason)
    return record


def dead_job(store: OJSStore, task_id: str) -> dict[str, Any] | None:
    """The dead-letter record of one job, or None when it is not dead-lettered."""
    raw = store.client.get(store.key("dead", task_id))
    return None if not raw else dict(json.loads(raw))


def dead_jobs(store: OJSStore) -> list[dict[str, Any]]:
    """Every dead-lettered job, oldest first."""
    names: list[Any] = store.client.zrange(store.key("dead-index"), 0, -1)
    if not names:
        return []
    keys = [store.key("dead", n.decode() if isinstance(n, bytes) else str(n)) for n in names]
    return [json.loads(v) for v in store.client.mget(keys) if v]


def retry_dead(app: Celery, store: OJSStore, task_id: str) -> bool:
    """Re-publish a dead job (same id) from its last checkpoint; False if unknown."""
    raw = store.client.get(store.key("dead", task_id))
    if not raw:
        return False
    record = json.loads(raw)
    headers = {k: v for k, v in record["headers"].items() if k != h.CRASHES}
    if record.get("last_checkpoint"):
        headers[h.LAST_CHECKPOINT] = record["last_checkpoint"]
    with plugin_publish():  # the plugin's own headers are kept
        app.send_task(
            record["name"],
            args=record["args"],
            kwargs=record["kwargs"],
            task_id=task_id,
            headers=headers,
        )
    with store.client.pipeline(transaction=True) as pipe:
        pipe.delete(store.key("dead", task_id))
        pipe.zrem(store.key("dead-index"), task_id)
        pipe.execute()
    return True
