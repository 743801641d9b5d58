"""Inference dedup (OJS ML §14.6), opt-in per task: a duplicate inside the window is not
published; the caller gets the first job's `AsyncResult`.

    @app.task(ml={"ext_ml_gpu_count": 1}, ml_dedup={"window_s": 30})
    def embed(text): ...

Key decision: the first publisher of a key (`key_of`, or `ml_dedup_key=` per call)
wins a `SET NX PX window` in the store, atomic across producers, and stores its task
id there for later callers. A publish that fails after winning deletes the key, so a
retry is not swallowed.

Layout: `<prefix>:{ml}:dedup:<task name>:<key>`  string  first task id, PX window
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Mapping
from typing import Any

from celery import Celery

from celery_ojs_ml.errors import ConfigError

log = logging.getLogger(__name__)
OPTION = "ml_dedup"


def install(app: Celery) -> None:
    """Wrap every task that declares `ml_dedup`: tasks built on the app's task class
    as they are created (a producer may publish before the app finalizes), any
    other one when the app finalizes."""
    base = app.Task

    class DedupTask(base):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if getattr(self, OPTION, None) is not None and not getattr(self, "_ojs_dedup", False):
                wrap(self)

    app.Task = DedupTask
    app.on_after_finalize.connect(_wrap_all, weak=False)
    if app.finalized:
        _wrap_all(app)


def _wrap_all(sender: Celery, **_: Any) -> None:
    for task in list(sender.tasks.values()):
        if getattr(task, OPTION, None) is not None and not getattr(task, "_ojs_dedup", False):
            wrap(task)


def window_of(task: Any) -> float:
    """The task's dedup window in seconds; a bad option is a ConfigError naming it."""
    opts = getattr(task, OPTION)
    window = opts.get("window_s") if isinstance(opts, Mapping) else None
    if isinstance(window, bool) or not isinstance(window, int | float) or not window > 0:
        raise ConfigError(
            f"task {task.name}: {OPTION}={opts!r}; use a mapping with window_s > 0, "
            f'e.g. {OPTION}={{"window_s": 30}}'
        )
    return float(window)


def key_of(name: str, args: Any, kwargs: Any) -> str:
    """The default key: the task name and a hash of the canonical JSON of its arguments
    (their repr where they are not JSON)."""
    try:
        blob = json.dumps([list(args or ()), dict(kwargs or {})], sort_keys=True)
    except (TypeError, ValueError):
        blob = repr((tuple(args or ()), sorted((kwargs or {}).items())))
    return f"{name}:{hashlib.sha256(blob.encode()).hexdigest()[:32]}"


def wrap(task: Any) -> None:
    """Make `task.apply_async` skip duplicates inside its window (see module doc).

    Nothing else in the task changes: `delay`, `apply_async` and signatures all go
    through the wrapped `apply_async`; `apply_async(..., ml_dedup_key="doc-42")` gives
    a call an explicit key.
    """
    window = window_of(task)
    original = task.apply_async

    def apply_async(
        args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        explicit = options.pop("ml_dedup_key", None)
        key = f"{task.name}:{explicit}" if explicit is not None else key_of(task.name, args, kwargs)
        store = task.app.ojs_ml.store
        slot = store.key("dedup", key)
        mine = task_id or str(uuid.uuid4())
        with task.app.ojs_ml.store_errors():
            won = store.client.set(slot, mine, nx=True, px=int(window * 1000))
            first = None if won else store.client.get(slot)
        if not won and first is not None:
            first_id = first.decode() if isinstance(first, bytes) else str(first)
            log.debug("ojs-ml: %s is a duplicate of %s; not published", key, first_id)
            return task.AsyncResult(first_id)
        try:
            return original(args, kwargs, task_id=mine, **options)
        except BaseException:
            store.client.delete(slot)
            raise

    task.apply_async = apply_async
    task._ojs_dedup = True
