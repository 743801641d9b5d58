"""`progress(self, step, total, **metrics)`: a running task reports how far it is.

    for step in range(total):
        loss = train_step()
        if step % 100 == 0:
            progress(self, step, total, loss=float(loss))

Key decisions:
* One report is one write to the result backend: `task.update_state` with state
  `PROGRESS` and the meta of `wire.progress` (the celery-progress convention, so
  Flower shows it and `AsyncResult(task_id).info` reads it). `celery ojs-ml status`
  and `explain` read that same record; nothing goes to the plugin's store.
* The `ojs-progress` event goes out only when the worker sends task events
  (`worker_send_task_events`, or `-E` / Flower's `enable_events`). A pool child
  cannot see the main process's event dispatcher, so it reads the switch from the
  worker's own heartbeat record, at most once every `EVENTS_RECHECK_S` seconds.
* Telemetry never fails a task: an event that cannot be sent is logged and
  dropped, and without a result backend the state is not stored. Bad arguments
  do raise, at once, naming the argument.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from celery.backends.base import DisabledBackend

from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire import progress as wire

log = logging.getLogger(__name__)
EVENTS_RECHECK_S = 10.0
"""How long a pool child trusts what it last read of its worker's task-events switch."""
_EVENTS: dict[str, tuple[float, bool]] = {}
"""Per worker hostname: (monotonic time read, task events on)."""
_WARNED: set[str] = set()


def progress(
    task: Any,
    step: int,
    total: int | None = None,
    **metrics: Any,
) -> dict[str, Any]:
    """Report `step` of `total` (None: unknown) with `metrics`; returns the stored meta.

    Call it as `progress(self, ...)` in a bound task. Each call is one write to the
    result backend, so report every N steps (about once a second or less often).
    """
    request = _request(task)
    step, total = wire.check_step(step, total)
    meta = wire.advance(request, step, total, wire.check_metrics(metrics), time.monotonic())
    if not isinstance(task.backend, DisabledBackend):
        task.update_state(state=wire.STATE, meta=meta)
    if _events_on(task):
        _send(task, meta)
    return meta


def _request(task: Any) -> Any:
    request = getattr(task, "request", None)
    if not getattr(request, "id", None):
        raise ConfigError(
            "progress(self, ...) needs the running task's request id; declare the task with "
            "bind=True and call it inside the task body, e.g. "
            "@app.task(bind=True) def train(self): progress(self, 10, 100, loss=0.31)"
        )
    return request


def event_fields(request: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """The `ojs-progress` event's fields (Celery adds `uuid` and `hostname`): the meta,
    and the job's logical queue and band when its request carries them."""
    queue = _header(request, h.LOGICAL)
    if queue is None:
        queue = (getattr(request, "delivery_info", None) or {}).get("routing_key")
    return {**meta, "queue": queue, "band": _header(request, h.BAND)}


def _send(task: Any, meta: dict[str, Any]) -> None:
    try:
        task.send_event(wire.EVENT, retry=False, **event_fields(task.request, meta))
    except Exception as exc:  # telemetry never fails the task
        _warn_once("event", "ojs-ml: could not send %s: %s", wire.EVENT, exc)


def _events_on(task: Any) -> bool:
    """Whether this worker sends task events: the app's setting, else the switch its
    main process advertises with each heartbeat (`info.task_events`)."""
    if task.app.conf.worker_send_task_events:
        return True
    hostname = getattr(task.request, "hostname", None)
    if not hostname:
        return False
    now = time.monotonic()
    seen = _EVENTS.get(hostname)
    if seen is not None and now - seen[0] < EVENTS_RECHECK_S:
        return seen[1]
    on = _advertised_events(task.app, hostname)
    _EVENTS[hostname] = (now, on)
    return on


def _advertised_events(app: Any, hostname: str) -> bool:
    plugin = getattr(app, "ojs_ml", None)
    if plugin is None:  # a plain Celery app: only its setting turns events on
        return False
    try:
        store = plugin.store
        raw = store.client.get(store.key("worker", hostname))
        return bool(raw) and bool(json.loads(raw).get("info", {}).get("task_events"))
    except Exception as exc:  # no store: no event; the state is still stored
        _warn_once("switch", "ojs-ml: cannot tell whether %s sends events: %s", hostname, exc)
        return False


def _header(request: Any, key: str) -> Any:
    value = getattr(request, key, None)
    if value is None:
        headers = getattr(request, "headers", None)
        value = headers.get(key) if isinstance(headers, dict) else None
    return value


def _warn_once(kind: str, message: str, *args: Any) -> None:
    level = logging.DEBUG if kind in _WARNED else logging.WARNING
    _WARNED.add(kind)
    log.log(level, message, *args)
