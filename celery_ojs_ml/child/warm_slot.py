"""A warm pool child's slot: the device set its CUDA is bound to, in shared memory.

Key decision: the table (`slots`, `next`) is created in the worker's main process
before the pool forks (`make_table`), so every child inherits it; a child writes
only its own slot (`bind_after_task`, `reset_slot`) and reads its `next` entry,
the devices the main process's router moved its job onto (`take_move`). The
format is `wire.warm_slots`; the router is `worker.warm_pool`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from multiprocessing.sharedctypes import RawArray
from typing import Any

from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.warm_slots import SLOTS, TAINTED, devices_of_mask, mask_of

log = logging.getLogger(__name__)
_TABLE: dict[str, Any] = {}


class WarmTable:
    """The shared table as the main process's router reads and writes it."""

    def __init__(self, slots: Any, moved: Any) -> None:
        self.slots, self.next = slots, moved

    def binding(self, index: int) -> int:
        """The slot value of pool child `index` (`wire.warm_slots`)."""
        return int(self.slots[index])

    def announce(self, index: int, mask: int) -> None:
        """Tell child `index` the devices its next job was moved to (0: not moved)."""
        self.next[index] = mask


def make_table() -> None:
    """Create the shared tables in the worker's main process, before the pool forks.

    `slots[i]`: the device set child `i` is bound to; `next[i]`: the devices of the
    job the router is writing to child `i` when it moved the job onto them.
    """
    if "slots" not in _TABLE:
        _TABLE["slots"] = RawArray("q", SLOTS)
        _TABLE["next"] = RawArray("q", SLOTS)


def table() -> WarmTable | None:
    """The shared table, or None where warm mode did not create it."""
    slots = _TABLE.get("slots")
    return None if slots is None else WarmTable(slots, _TABLE["next"])


def _index() -> int | None:
    """This pool child's slot (read once per process: it is asked twice per task)."""
    pid = os.getpid()
    if _TABLE.get("pid") != pid:
        import billiard.process

        index = getattr(billiard.process.current_process(), "index", None)
        _TABLE["index"] = index if isinstance(index, int) and 0 <= index < SLOTS else None
        _TABLE["pid"] = pid
    found: int | None = _TABLE["index"]
    return found


def reset_slot() -> None:
    """`worker_process_init` in a child: a fresh child is unbound."""
    slots, index = _TABLE.get("slots"), _index()
    if slots is not None and index is not None:
        slots[index] = 0
        _TABLE["next"][index] = 0


def take_move(request: Any) -> None:
    """`task_prerun` in a child: the router moved this job onto this child's devices."""
    if _TABLE.get("slots") is None:
        return
    index = _index()
    if index is None:
        return
    moved = int(_TABLE["next"][index])
    _TABLE["next"][index] = 0
    if moved and getattr(request, h.DEVICES, None) is not None:
        request.ojs_devices = devices_of_mask(moved)


def bind_after_task(devices: list[int] | None, cuda_up: Callable[[], bool]) -> None:
    """`task_postrun` in a child: record the device set CUDA came up with, once."""
    slots, index = _TABLE.get("slots"), _index()
    if slots is None or index is None or slots[index] != 0 or not cuda_up():
        return
    slots[index] = mask_of(devices) if devices else TAINTED
    log.debug("ojs-ml: pool child %s bound to devices %s", index, devices or "all (tainted)")
