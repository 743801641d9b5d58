"""celery-ojs-ml: OJS ML resource-aware routing, GPU gating and checkpoints for Celery.

Public API: `OJSML(app)` (the plugin), `checkpoint(task)` (the task-side
checkpoint helper), `Preempted`, `devices(task)` (a task's GPU indices),
`model(task, key, loader)` (a model loaded once per pool child) and
`limit_torch_memory(task)` (cap torch at a GPU share, docs/sharing.md).
Names are imported lazily so that `celery_ojs_ml.spec` stays importable alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_ojs_ml.checkpoint import Preempted, checkpoint
    from celery_ojs_ml.child.models import model
    from celery_ojs_ml.child.pinning import devices
    from celery_ojs_ml.child.sharing import limit_torch_memory
    from celery_ojs_ml.plugin import OJSML

__all__ = ["OJSML", "Preempted", "checkpoint", "devices", "limit_torch_memory", "model"]
__version__ = "0.1.0"

_LAZY = {
    "OJSML": ("celery_ojs_ml.plugin", "OJSML"),
    "devices": ("celery_ojs_ml.child.pinning", "devices"),
    "model": ("celery_ojs_ml.child.models", "model"),
    "checkpoint": ("celery_ojs_ml.checkpoint", "checkpoint"),
    "Preempted": ("celery_ojs_ml.checkpoint", "Preempted"),
    "limit_torch_memory": ("celery_ojs_ml.child.sharing", "limit_torch_memory"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'celery_ojs_ml' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
