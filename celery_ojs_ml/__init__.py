"""celery-ojs-ml: OJS ML resource-aware routing, GPU gating and checkpoints for Celery.

Public API: `OJSML(app)` (the plugin), `checkpoint(task)` (the task-side
checkpoint helper), `Preempted`, `devices(task)` (a task's GPU indices),
`model(task, key, loader)` (a model loaded once per pool child),
`limit_torch_memory(task)` (cap torch at a GPU share, docs/sharing.md),
`progress(task, step, total, **metrics)` (report how far a task is) and
`evaluate(task, metrics)` with `ThresholdsNotMet` (the OJS ML Extensions §5.4
evaluation gate; docs/tasks.md).
Names are imported lazily so that `celery_ojs_ml.spec` stays importable alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_ojs_ml.checkpoint import Preempted, checkpoint
    from celery_ojs_ml.child.evaluation import evaluate
    from celery_ojs_ml.child.models import model
    from celery_ojs_ml.child.pinning import devices
    from celery_ojs_ml.child.progress import progress
    from celery_ojs_ml.child.sharing import limit_torch_memory
    from celery_ojs_ml.errors import ThresholdsNotMet
    from celery_ojs_ml.plugin import OJSML

__all__ = [
    "OJSML",
    "Preempted",
    "ThresholdsNotMet",
    "checkpoint",
    "devices",
    "evaluate",
    "limit_torch_memory",
    "model",
    "progress",
]
__version__ = "0.1.0"

_LAZY = {
    "OJSML": ("celery_ojs_ml.plugin", "OJSML"),
    "devices": ("celery_ojs_ml.child.pinning", "devices"),
    "model": ("celery_ojs_ml.child.models", "model"),
    "checkpoint": ("celery_ojs_ml.checkpoint", "checkpoint"),
    "Preempted": ("celery_ojs_ml.checkpoint", "Preempted"),
    "limit_torch_memory": ("celery_ojs_ml.child.sharing", "limit_torch_memory"),
    "progress": ("celery_ojs_ml.child.progress", "progress"),
    "evaluate": ("celery_ojs_ml.child.evaluation", "evaluate"),
    "ThresholdsNotMet": ("celery_ojs_ml.errors", "ThresholdsNotMet"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'celery_ojs_ml' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
