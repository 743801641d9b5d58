"""Warm GPU children (`ojs_ml_recycle_gpu_children = "warm"`): route each job to a child
whose CUDA is bound to exactly the job's devices, or to a fresh child.

This is the one module that touches celery's prefork internals (AsynPool's
write scheduler); `missing_internals()` names what it relies on and a test
fails when one changes. Checked against celery 5.7.0 / billiard 4.3.2.

Key decisions (DESIGN decision 3):
- **Binding.** CUDA reads `CUDA_VISIBLE_DEVICES` once per process. After each
  task a pool child that has CUDA initialised records, once, the device set it
  was initialised with (the task's allocation) in a shared-memory table slot
  indexed by its billiard process index (`bind_after_task`). A child whose
  CUDA came up outside a GPU task (no devices) is marked tainted: it never
  runs a GPU job again.
- **Routing.** The pool writes a job to a child when that child's pipe is
  writable (`hub.consolidate_callback`, celery's `schedule_writes`). We wrap
  that callback: for each waiting job we pick the idle child to write it to,
  move the job to the front of the outbound buffer and call the original with
  that one pipe. A GPU job goes to an idle child bound to exactly its devices,
  else to an unbound child; a job without devices prefers an unbound child.
  A GPU job no idle child is bound to is moved onto the devices of an idle
  child bound to as many: free ones, or those held by a later job that no
  child has taken yet, which gets the first job's devices in exchange (jobs
  waiting for a pool process hold their devices; without the exchange a later
  job would take the warm child first and the earlier one would wait on).
- **Retirement.** When a GPU job has no eligible idle child but idle children
  bound to other devices exist, the least recently used of them is
  terminated (billiard starts a fresh one); the job waits for it. So a child
  is retired only when the work needs a device set no idle child is bound to
  and the pool cannot otherwise serve it.
- **Device choice.** The gate prefers, among free devices, a set an idle
  child is bound to (`Router.idle_bound`), so with one child per GPU almost
  every job lands warm.
- The invariant, for every task: the device set the process's CUDA was
  initialised with equals the task's allocation. It holds by construction:
  a bound child only ever receives jobs with exactly its devices.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from multiprocessing.sharedctypes import RawArray
from typing import Any

log = logging.getLogger(__name__)

SLOTS = 4096
"""Pool process indices the table covers (autoscaled pools index from 0 up)."""
TAINTED = -1
"""Slot value of a child whose CUDA was initialised with no allocation (all devices)."""
_TABLE: dict[str, Any] = {}
_RETIRE_AFTER_S = 0.05
Move = Callable[[str, tuple[int, ...], Callable[[str], bool]], dict[str, tuple[int, ...]]]
"""The gate's `_move(task_id, devices, written)`: the jobs whose devices it changed ({} if none)."""


def make_table() -> None:
    """Create the shared tables in the worker's main process, before the pool forks.

    `slots[i]`: the device set child `i` is bound to; `next[i]`: the devices of the
    job the router is writing to child `i` when it moved the job onto them.
    """
    if "slots" not in _TABLE:
        _TABLE["slots"] = RawArray("q", SLOTS)
        _TABLE["next"] = RawArray("q", SLOTS)


def _slots() -> Any:
    return _TABLE.get("slots")


def mask_of(devices: Iterable[int]) -> int:
    """A device set as a bit mask (bit 62 marks 'bound', so a set is never 0)."""
    mask = 1 << 62
    for d in devices:
        if not 0 <= int(d) < 62:
            raise ValueError(f"device index {d} outside 0-61")
        mask |= 1 << int(d)
    return mask


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
    slots, index = _slots(), _index()
    if slots is not None and index is not None:
        slots[index] = 0
        _TABLE["next"][index] = 0


def take_move(request: Any) -> None:
    """`task_prerun` in a child: the router moved this job onto this child's devices."""
    if _slots() is None:
        return
    index = _index()
    if index is None:
        return
    moved = int(_TABLE["next"][index])
    _TABLE["next"][index] = 0
    if moved and getattr(request, "ojs_devices", None) is not None:
        request.ojs_devices = devices_of_mask(moved)


def devices_of_mask(mask: int) -> list[int]:
    """The device indices of a `mask_of` mask."""
    return [i for i in range(62) if mask >> i & 1]


def bind_after_task(devices: list[int] | None, cuda_up: Callable[[], bool]) -> None:
    """`task_postrun` in a child: record the device set CUDA came up with, once."""
    slots, index = _slots(), _index()
    if slots is None or index is None or slots[index] != 0 or not cuda_up():
        return
    slots[index] = mask_of(devices) if devices else TAINTED
    log.debug("ojs-ml: pool child %s bound to devices %s", index, devices or "all (tainted)")


def pool_pids(c: Any) -> list[int]:
    """Pids of the consumer's prefork pool children ([] for other pools)."""
    procs = getattr(getattr(getattr(c, "pool", None), "_pool", None), "_pool", None) or []
    return [int(p.pid) for p in procs if getattr(p, "pid", None)]


def missing_internals(pool: Any = None, hub: Any = None) -> list[str]:
    """What this module needs from celery's AsynPool (and the hub) that is not there."""
    from celery.concurrency import asynpool

    need = ("_create_write_handlers", "register_with_event_loop")
    missing = [f"AsynPool.{n}" for n in need if not hasattr(asynpool.AsynPool, n)]
    if pool is not None:
        for name in ("outbound_buffer", "_fileno_to_inq", "_busy_workers", "_active_writes"):
            if not hasattr(pool, name):
                missing.append(f"AsynPool().{name}")
    if hub is not None and not callable(getattr(hub, "consolidate_callback", None)):
        missing.append("Hub.consolidate_callback")
    return missing


class Router:
    """Wraps the pool's write scheduler in the worker's main process (see module doc)."""

    def __init__(
        self,
        pool: Any,
        hub: Any,
        devices_of: Callable[[str], tuple[int, ...] | None],
        move: Move,
    ):
        self.pool, self.hub, self.devices_of, self.move = pool, hub, devices_of, move
        self.original: Callable[..., Any] = hub.consolidate_callback
        self.last_used: dict[int, float] = {}
        self.retired = 0
        self.warm_hits = 0
        self._moved: dict[str, int] = {}
        """Jobs whose devices changed after their message was built: the child is told."""
        self._written: set[str] = set()
        """Jobs written to a child (their devices can no longer change)."""
        self._stuck: dict[str, float] = {}
        """Jobs no idle child could take, since when (retirement waits `_RETIRE_AFTER_S`)."""
        hub.consolidate_callback = self.schedule

    @classmethod
    def install(
        cls,
        c: Any,
        devices_of: Callable[[str], tuple[int, ...] | None],
        move: Move,
    ) -> Router | None:
        """Wrap the pool of consumer `c`, or None (logged) where that is not possible.

        Call it from a consumer step's `register_with_event_loop`: the hub reads
        `consolidate_callback` once, when its loop is created.
        """
        pool = getattr(getattr(c, "pool", None), "_pool", None)
        hub = getattr(c, "hub", None)
        if pool is None or hub is None or _slots() is None:
            log.warning(
                "ojs-ml: warm children off: no %s",
                "pool" if pool is None else "event loop" if hub is None else "table",
            )
            return None
        missing = missing_internals(pool, hub)
        if missing:
            log.warning("ojs-ml: warm children off; celery internals changed: %s", missing)
            return None
        return cls(pool, hub, devices_of, move)

    # -- the table, as the main process reads it ---------------------------------------

    def _binding(self, fd: int) -> int | None:
        proc = self.pool._fileno_to_inq.get(fd)
        index = getattr(proc, "index", None)
        return None if index is None else int(_slots()[index])

    def _idle(self, ready: Iterable[int]) -> list[int]:
        pool = self.pool
        busy, active = pool._busy_workers, pool._active_writes
        return [fd for fd in ready if fd not in busy and fd not in active]

    def idle_bound(self, first: Callable[[int], bool] | None = None) -> list[tuple[int, ...]]:
        """Device sets of idle children bound to them (the gate prefers these); those of
        children whose pid `first` picks (they hold the job's model) come first."""
        out = []
        for fd in self._idle(list(self.pool._fileno_to_inq)):
            binding = self._binding(fd)
            if binding and binding != TAINTED:
                pid = getattr(self.pool._fileno_to_inq.get(fd), "pid", 0)
                out.append((not (first and first(pid)), tuple(devices_of_mask(binding))))
        return [devices for _, devices in sorted(out)]

    # -- routing ---------------------------------------------------------------------

    def schedule(self, ready_fds: list[int], *args: Any, **kwargs: Any) -> Any:
        outbound = self.pool.outbound_buffer
        idle = self._idle(ready_fds)
        if not outbound or not idle:
            return self.original(ready_fds, *args, **kwargs)
        for job in list(outbound):
            if not idle:
                break
            fd = self._choose(job, idle)
            if fd is None:
                continue
            idle.remove(fd)
            task_id = str(getattr(job, "correlation_id", ""))
            self._stuck.pop(task_id, None)
            self._written.add(task_id)
            self._announce(fd, task_id)
            outbound.remove(job)
            outbound.appendleft(job)
            self.last_used[fd] = time.monotonic()
            self.original([fd], *args, **kwargs)
        return None

    def _choose(self, job: Any, idle: list[int]) -> int | None:
        devices = self.devices_of(str(getattr(job, "correlation_id", "")))
        bindings = {fd: self._binding(fd) for fd in idle}
        if not devices:  # no GPUs: a fresh child first, then any
            fresh = [fd for fd in idle if not bindings[fd]]
            return (fresh or idle)[0]
        want = mask_of(devices)
        for fd in idle:
            if bindings[fd] == want:
                self.warm_hits += 1
                return fd
        task_id = str(getattr(job, "correlation_id", ""))
        for fd in idle:  # a child bound to other devices of the same count: move the job
            bound = bindings[fd] or 0
            if bound > 0 and bin(bound).count("1") == bin(want).count("1"):
                repinned = self.move(
                    task_id, tuple(devices_of_mask(bound)), self._written.__contains__
                )
                for moved, devices in repinned.items():
                    self._moved[moved] = mask_of(devices)
                if repinned:
                    self.warm_hits += 1
                    return fd
        for fd in idle:
            if not bindings[fd]:
                return fd
        # The child just freed may not have released its devices yet (the result and
        # the release are handled in the same loop turn): wait a moment before retiring.
        if len(self._stuck) > 10_000:  # revoked while waiting: never routed, never popped
            self._stuck.clear()
        since = self._stuck.setdefault(task_id, time.monotonic())
        if time.monotonic() - since > _RETIRE_AFTER_S:
            self._stuck.pop(task_id, None)
            self._retire_one(idle, bindings)
        return None

    def _announce(self, fd: int, task_id: str) -> None:
        """Tell the child, before it reads the job, which devices the job was moved to."""
        proc = self.pool._fileno_to_inq.get(fd)
        index = getattr(proc, "index", None)
        if index is not None:
            _TABLE["next"][index] = self._moved.pop(task_id, 0)

    def finished(self, task_id: str) -> None:
        """The gate released the job: forget it."""
        self._written.discard(task_id)
        self._moved.pop(task_id, None)

    def _retire_one(self, idle: list[int], bindings: dict[int, int | None]) -> None:
        """No idle child can take the job: retire the least recently used bound one."""
        bound = [fd for fd in idle if bindings[fd]]
        if not bound:
            return
        fd = min(bound, key=lambda f: self.last_used.get(f, 0.0))
        proc = self.pool._fileno_to_inq.get(fd)
        if proc is None or getattr(proc, "_ojs_retiring", False):
            return
        proc._ojs_retiring = True
        self.retired += 1
        log.info("ojs-ml: retiring pool child %s (bound elsewhere) for a new device set",
                 getattr(proc, "pid", "?"))  # fmt: skip
        proc.terminate()
