"""Task-side checkpoints and preemption: resume, two-phase save, retention, the preemption flag.

    ckpt = checkpoint(self)      # in a bound task with `ext_ml_checkpoint_enabled`
    last = ckpt.resume()         # None, or the committed last checkpoint
    ckpt.save(epoch=epoch, step=step, loss=loss, files={"model.pt": buf})
    ckpt.yield_if_preempted()    # raises `Preempted` at a safe point

Key decision: the package is callable and does what the `checkpoint()` function
does, since `from celery_ojs_ml import checkpoint` may return either
(`_CallablePackage`, docs/checkpoint.md).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from celery_ojs_ml.checkpoint.helper import Checkpointer
from celery_ojs_ml.checkpoint.model import CheckpointError, CheckpointMeta, CheckpointSettings
from celery_ojs_ml.checkpoint.preempt import (
    LeaseLost,
    Preempted,
    clear_preemption,
    flag_set,
    install_child_handler,
    preemption_request,
    preemption_requested,
    request_preemption,
    reset_flag,
)
from celery_ojs_ml.checkpoint.retention import (
    delete_checkpoints,
    last_checkpoint,
    list_checkpoints,
)
from celery_ojs_ml.checkpoint.storage import (
    clear_storage_options,
    register_storage_options,
    storage_options_for,
)
from celery_ojs_ml.checkpoint.task import HEADER_LAST, RESUME_FROM, checkpoint
from celery_ojs_ml.checkpoint.writer import CheckpointWriter

__all__ = [
    "HEADER_LAST",
    "RESUME_FROM",
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointSettings",
    "CheckpointWriter",
    "Checkpointer",
    "LeaseLost",
    "Preempted",
    "checkpoint",
    "clear_preemption",
    "clear_storage_options",
    "delete_checkpoints",
    "flag_set",
    "install_child_handler",
    "last_checkpoint",
    "list_checkpoints",
    "preemption_request",
    "preemption_requested",
    "register_storage_options",
    "request_preemption",
    "reset_flag",
    "storage_options_for",
]


class _CallablePackage(types.ModuleType):
    """This package, callable as `checkpoint(task)`.

    The package shares its name with the `checkpoint()` function that `celery_ojs_ml`
    re-exports. Once any submodule is imported, Python binds `celery_ojs_ml.checkpoint`
    to this package, so `from celery_ojs_ml import checkpoint` can return the package
    instead of the function; callable, it does what the function does, whichever of
    the two a task ends up holding.
    """

    def __call__(self, task: Any, *, report_progress: bool = True) -> Checkpointer:
        return checkpoint(task, report_progress=report_progress)


sys.modules[__name__].__class__ = _CallablePackage
