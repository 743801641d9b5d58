"""`checkpoint(self)`: the `Checkpointer` of a running bound Celery task.

Key decisions:
- Settings come from the request first: the router stamps the canonical
  `ext_ml_*` attributes into the message headers, and Celery exposes custom
  headers both as request attributes and in `request.headers` (eager `apply()`
  puts them only in the latter). The task's `ml=` option fills what the
  message lacks, so a task called without the router still checkpoints.
- Events are `ojs-checkpoint-*`, never `task-*`: a custom `task-<x>` event
  would leave a sticky state in Flower (research/celery-internals.md §5).
- A save with a step also stores the task's `PROGRESS` state (`wire.progress`),
  one backend write beside the checkpoint's own, unless the task reports its
  own progress: its steps may count something else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.checkpoint.helper import SAVED, Checkpointer, Emit
from celery_ojs_ml.checkpoint.model import SETTING_KEYS, STORAGE_URI, CheckpointSettings
from celery_ojs_ml.checkpoint.storage import storage_options_for
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.spec.normalize import DEFAULT_BOUNDS, Bounds
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire import progress as wire_progress
from celery_ojs_ml.wire.settings import RestoreMode

HEADER_LAST = h.LAST_CHECKPOINT
"""Header carrying the `last_checkpoint` of a re-published (preempted or crashed) job."""
HEADER_LEASE = h.LEASE
"""Set by the worker's gate: the token of the lease this run holds (fences its commits)."""
log = logging.getLogger(__name__)
RESUME_FROM = "ext_mlx_training_resume_from"
"""OJS ML Extensions §5.1: a checkpoint URI to resume training from."""


def checkpoint(task: Any, *, report_progress: bool = True) -> Checkpointer:
    """The checkpoint helper of the running task; call it as `checkpoint(self)` in a bound task.

    With `report_progress`, each save with a step stores it as the task's progress.
    """
    request = getattr(task, "request", None)
    job_id = getattr(request, "id", None)
    if not job_id:
        raise ConfigError(
            "checkpoint(self) needs the running task's request id; declare the task with "
            "bind=True and call it inside the task body, e.g. "
            "@app.task(bind=True, ml={...}) def train(self): ckpt = checkpoint(self)"
        )
    attrs = _declared(task, request)
    conf = task.app.conf
    store = _store(task.app)
    settings = CheckpointSettings.from_attrs(
        attrs,
        bounds=_bounds(task.app),
        storage_options=_options(attrs.get(STORAGE_URI), conf),
        restore=_restore_mode(task.app),
    )
    return Checkpointer(
        str(job_id),
        settings,
        store,
        emit=_emitter(task, report_progress),
        header_last=_header(request, HEADER_LAST),
        resume_from=attrs.get(RESUME_FROM),
        app_conf=conf,
        lease_token=_header(request, HEADER_LEASE),
    )


def _declared(task: Any, request: Any) -> dict[str, Any]:
    attrs = {k: v for k, v in (getattr(task, "ml", None) or {}).items() if v is not None}
    for key in (*SETTING_KEYS, RESUME_FROM):
        value = _header(request, key)
        if value is not None:
            attrs[key] = value
    return attrs


def _header(request: Any, key: str) -> Any:
    value = getattr(request, key, None)
    if value is None:
        headers = getattr(request, "headers", None)
        value = headers.get(key) if isinstance(headers, Mapping) else None
    return value


def _options(uri: Any, conf: Mapping[str, Any]) -> dict[str, Any]:
    return storage_options_for(uri, conf) if isinstance(uri, str) else {}


def _bounds(app: Any) -> Bounds:
    plugin = getattr(app, "ojs_ml", None)
    options = getattr(plugin, "parse_options", None) if plugin is not None else None
    bounds = getattr(options, "bounds", None)
    return bounds if isinstance(bounds, Bounds) else DEFAULT_BOUNDS


def _restore_mode(app: Any) -> RestoreMode:
    settings = getattr(getattr(app, "ojs_ml", None), "settings", None)
    mode = getattr(settings, "checkpoint_restore", "committed")
    return "own_directory" if mode == "own_directory" else "committed"


def _store(app: Any) -> OJSStore:
    store = getattr(getattr(app, "ojs_ml", None), "store", None)
    if not isinstance(store, OJSStore):
        raise ConfigError(
            "checkpoint(self) keeps its metadata in the OJS ML store, but the app has no "
            "OJS ML plugin; install it, e.g. `OJSML(app)` with app.conf.ojs_ml_store_url set"
        )
    return store


def _emitter(task: Any, report_progress: bool = True) -> Emit:
    queue = _header(getattr(task, "request", None), h.LOGICAL)  # the exporter's label
    extra = {"queue": queue} if isinstance(queue, str) else {}

    def emit(event: str, fields: dict[str, Any]) -> None:
        if report_progress and event == SAVED:
            _saved_progress(task, fields)
        task.send_event(event, **fields, **extra)

    return emit


def _saved_progress(task: Any, fields: dict[str, Any]) -> None:
    try:
        meta = wire_progress.from_checkpoint(task.request, fields, time.monotonic())
        if meta is not None:
            task.update_state(state=wire_progress.STATE, meta=meta)
    except Exception as exc:  # no result backend, or it is down: the save stands
        log.debug("ojs-ml: could not store the progress of %s: %s", task.request.id, exc)
