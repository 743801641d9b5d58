"""The pool child's signal hooks, and the child state the worker's main process sets.

Key decisions:
* One receiver per signal (`task_prerun`, `task_postrun`, `worker_process_init`):
  Celery sends each signal that has receivers once per task, and `task_success`
  has none (a gang rank's success is stored from `task_postrun`).
* The recycling mode, the worker's visible devices and the warm table are
  process state the main process sets at `celeryd_init`, before the pool forks,
  through `PoolChildren` (the worker never imports this package: `plugin.py`
  hands it over), and every child inherits by fork.
"""

from __future__ import annotations

from typing import Any

from celery import signals
from celery.states import SUCCESS

from celery_ojs_ml.checkpoint.preempt import reset_flag
from celery_ojs_ml.child import limits, pinning, warm_slot
from celery_ojs_ml.child.gang_env import is_rank, store_rank_result
from celery_ojs_ml.wire import headers as h

_WATCH: dict[str, Any] = {}


class PoolChildren:
    """The pool children's process state as the worker's main process sets it."""

    no_limit_kb = pinning.NO_LIMIT_KB

    def mode(self) -> str:
        """`ojs_ml_recycle_gpu_children` as the worker resolved it (`child.RECYCLE`)."""
        return str(pinning.RECYCLE["mode"])

    def set_mode(self, mode: str) -> None:
        pinning.RECYCLE["mode"] = mode

    def visible(self) -> list[str] | None:
        return pinning.VISIBLE["tokens"]

    def set_visible(self, tokens: list[str] | None) -> None:
        pinning.VISIBLE["tokens"] = tokens

    def make_table(self) -> None:
        warm_slot.make_table()

    def table(self) -> warm_slot.WarmTable | None:
        return warm_slot.table()

    def can_retire(self) -> bool:
        return pinning.billiard_can_retire()


POOL_CHILDREN = PoolChildren()


def install() -> None:
    """Connect the pool child's hooks (the plugin does, once per process)."""
    signals.task_prerun.connect(child_prerun, weak=False)  # pins the devices
    signals.task_postrun.connect(child_postrun, weak=False)  # unpins; stores gang ranks
    signals.worker_process_init.connect(child_init, weak=False)


def child_init(**_: Any) -> None:
    """`worker_process_init`: the preemption flag on SIGUSR2, and CUDA retirement."""
    from celery_ojs_ml.checkpoint import install_child_handler

    install_child_handler()
    if pinning.RECYCLE["mode"] == "cuda":
        pinning.install_cuda_retirement()
    if pinning.RECYCLE["mode"] == "warm":
        warm_slot.reset_slot()
        _WATCH["cuda"] = pinning.DriverWatch()


def child_prerun(task: Any = None, **_: Any) -> None:
    """`task_prerun` in a pool child: clear the preemption flag, then pin the devices
    (`pinning.pin_request`)."""
    reset_flag()
    pinning.pin_request(getattr(task, "request", None))


def child_postrun(task: Any = None, retval: Any = None, state: Any = None, **_: Any) -> None:
    """`task_postrun` in a pool child: restore the environment (`pinning.unpin_request`),
    store a gang rank's success (`gang_env.store_rank_result`), and in warm mode record
    the device set the child's CUDA came up with (`warm_slot.bind_after_task`)."""
    request = getattr(task, "request", None)
    try:
        if request is not None:
            limits.finish(task, request, state, retval)  # names a failure past its memory bound
        pinning.unpin_request(request)
        if state == SUCCESS and is_rank(request):
            store_rank_result(sender=task, result=retval)
    finally:
        watch = _WATCH.get("cuda")
        if watch is not None:
            devices = getattr(request, h.DEVICES, None)
            warm_slot.bind_after_task(list(devices) if devices else None, watch)
