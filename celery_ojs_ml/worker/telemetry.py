"""The worker's `ojs-*` events for monitoring: a job started (with its wait), a job crashed.

Key decision: sent on the consumer's own event dispatcher only while this worker
sends task events (`-E`, or Flower's `enable_events`): with events off the cost is
one attribute check, and nothing is written to the store. The exporter
(`celery ojs-ml metrics`) counts them; Flower ignores `ojs-*` events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.celery_internals import task_events_on
from celery_ojs_ml.wire import headers as h

log = logging.getLogger("celery_ojs_ml.worker.core")

STARTED, CRASHED = "ojs-started", "ojs-crashed"


def send(consumer: Any, kind: str, **fields: Any) -> None:
    """Send one `ojs-*` event while task events are on; never raises."""
    if not task_events_on(consumer):
        return
    try:
        consumer.event_dispatcher.send(kind, **fields)
    except Exception as exc:  # telemetry never fails a job
        log.debug("ojs-ml: could not send %s: %s", kind, exc)


def started(consumer: Any, task_id: str, headers: Mapping[str, Any]) -> None:
    """`ojs-started`: the gate dispatched an ML job. `wait_s` runs from its admission
    (`ojs_submitted_at`, set by the leader's delivery) or its publish under a grant
    (`ojs_grant_at`); None when the message carries neither."""
    if not task_events_on(consumer):
        return
    since = headers.get(h.SUBMITTED) or headers.get(h.GRANT_AT)
    wait_s = None
    if isinstance(since, int | float) and not isinstance(since, bool):
        wait_s = max(0.0, time.time() - since)
    band, queue = headers.get(h.BAND) or "", headers.get(h.LOGICAL) or ""
    send(consumer, STARTED, uuid=task_id, band=band, queue=queue, wait_s=wait_s)


def crashed(consumer: Any, lease: Mapping[str, Any], crashes: int, dead: bool) -> None:
    """`ojs-crashed`: this worker claimed the lease of a job whose worker died (or took
    back its own after a restart); `dead`: it crashed too often and is dead-lettered."""
    queue = (lease.get("headers") or {}).get(h.LOGICAL) or ""
    fields = {"uuid": lease.get("task_id"), "queue": queue, "crashes": crashes, "dead": dead}
    send(consumer, CRASHED, **fields)
