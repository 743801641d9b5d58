"""Refusing a message the gate cannot run: dead-letter it with the reason, fail it, drop it.

Key decision: the job is kept (`celery ojs-ml dead` lists it, `dead --retry`
re-publishes it), its caller sees a failure instead of waiting forever, and the
worker carries on with the next message; an oversized header is not copied into
the store.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker import state as worker_state

from celery_ojs_ml.store.deadletter import dead_letter
from celery_ojs_ml.wire.inbound import BadMessage
from celery_ojs_ml.wire.records import job_record, republish_headers

log = logging.getLogger("celery_ojs_ml.worker.core")


def refuse(store: Any, hostname: str, max_header_bytes: int, req: Any, reason: str) -> None:
    """End `req` with `reason` (see module doc)."""
    log.error("ojs-ml: refusing %s[%s]: %s", req.name, req.id, reason)
    headers = republish_headers(req.request_dict)
    if len(repr(headers)) > 2 * max_header_bytes:
        headers = {}  # an oversized header is not copied into the store
    record = job_record(req.id, req.name, req.args, req.kwargs, headers, retries=0)
    for step in (
        lambda: dead_letter(store, record, f"refused by {hostname}: {reason}"),
        lambda: refused_result(req, reason),
    ):
        try:
            step()
        except Exception as exc:
            log.warning("ojs-ml: while refusing %s: %s", req.id, exc)
    worker_state.task_ready(req)
    req.reject(requeue=False)


def refused_result(req: Any, reason: str) -> None:
    """Record a refused job as failed (result backend, `task-failed` event) with the reason."""
    exc = BadMessage(reason)
    req.task.backend.mark_as_failure(req.id, exc, request=None)
    req.send_event("task-failed", exception=repr(exc), traceback="")
