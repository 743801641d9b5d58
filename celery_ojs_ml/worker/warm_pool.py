"""Warm GPU children (`ojs_ml_recycle_gpu_children = "warm"`): route each job to a child
whose CUDA is bound to exactly the job's devices, or to a fresh child.

The pool's internals are read through `celery_ojs_ml.celery_internals`; the shared slot table
is the child's (`child.warm_slot`, format `wire.warm_slots`).

Key decision (DESIGN decision 3): the device set a process's CUDA was initialised with
equals the task's allocation, so a bound child only ever receives jobs with its
devices. The `Router` wraps the pool's write scheduler to give each waiting job an idle
child bound to its devices (else an unbound one), and retires the least recently used
bound child when none can take it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from celery_ojs_ml import celery_internals as internals
from celery_ojs_ml.wire.warm_slots import TAINTED, devices_of_mask, mask_of

log = logging.getLogger(__name__)

_RETIRE_AFTER_S = 0.05
Move = Callable[[str, tuple[int, ...], Callable[[str], bool]], dict[str, tuple[int, ...]]]
"""The gate's `move(task_id, devices, written)`: the jobs whose devices it changed ({} if none)."""


class SlotTable(Protocol):
    """The shared slot table as the router reads it (`child.warm_slot.WarmTable`)."""

    def binding(self, index: int) -> int: ...

    def announce(self, index: int, mask: int) -> None: ...


class Router:
    """Wraps the pool's write scheduler in the worker's main process.

    - **Binding.** After each task a pool child with CUDA initialised records, once,
      the device set it was initialised with in its slot; one whose CUDA came up
      outside a GPU task is tainted and never runs a GPU job again.
    - **Routing.** For each waiting job the router picks the idle child to write it to
      (bound to exactly its devices, else unbound; a job without devices prefers an
      unbound child), moves the job to the front of the outbound buffer and calls the
      original with that one pipe. A GPU job no idle child is bound to is moved onto
      the devices of an idle child bound to as many: free ones, or those of a later
      job no child has taken yet, which gets the first job's devices in exchange.
    - **Retirement.** When a GPU job has no eligible idle child but idle children
      bound to other devices exist, the least recently used is terminated (billiard
      starts a fresh one); the job waits for it.

    The worker hands it the slot table (`plugin.py` connects the two).
    """

    def __init__(
        self,
        pool: Any,
        hub: Any,
        devices_of: Callable[[str], tuple[int, ...] | None],
        move: Move,
        table: SlotTable,
    ):
        self.pool, self.hub, self.devices_of, self.move = pool, hub, devices_of, move
        self.table = table
        self.last_used: dict[int, float] = {}
        self.retired = 0
        self.warm_hits = 0
        self._moved: dict[str, int] = {}
        """Jobs whose devices changed after their message was built: the child is told."""
        self._written: set[str] = set()
        self._moved_at_write: set[str] = set()
        """Written with other devices announced: nothing follows them (the announcement
        is read when they start)."""
        """Jobs written to a child (their devices can no longer change)."""
        self._stuck: dict[str, float] = {}
        """Jobs no idle child could take, since when (retirement waits `_RETIRE_AFTER_S`)."""
        self._at: dict[str, tuple[int, int]] = {}
        """Jobs written to a child and not moved: (pipe, pid) of that child."""
        self._behind: dict[str, str] = {}
        """Pipelined jobs not handed over yet -> the running job they follow."""
        self._queued: dict[int, tuple[int, str]] = {}
        """Pipe -> (pid, job) of a child that has a pipelined job to run (it is busy)."""
        self.pipelined = 0
        self.original = internals.wrap_write_scheduler(hub, self.schedule)

    @classmethod
    def install(
        cls,
        c: Any,
        devices_of: Callable[[str], tuple[int, ...] | None],
        move: Move,
        table: SlotTable | None,
    ) -> Router | None:
        """Wrap the pool of consumer `c`, or None (logged) where that is not possible.

        Call it from a consumer step's `register_with_event_loop`: the hub reads
        the write scheduler once, when its loop is created.
        """
        pool = internals.async_pool(c)
        hub = getattr(c, "hub", None)
        if pool is None or hub is None or table is None:
            log.warning(
                "ojs-ml: warm children off: no %s",
                "pool" if pool is None else "event loop" if hub is None else "table",
            )
            return None
        missing = internals.missing_internals(pool, hub)
        if missing:
            log.warning("ojs-ml: warm children off; celery internals changed: %s", missing)
            return None
        return cls(pool, hub, devices_of, move, table)

    # -- the table, as the main process reads it ---------------------------------------

    def _binding(self, fd: int) -> int | None:
        index = getattr(internals.process_of(self.pool, fd), "index", None)
        return None if index is None else self.table.binding(int(index))

    def idle_bound(self, first: Callable[[int], bool] | None = None) -> list[tuple[int, ...]]:
        """Device sets of idle children bound to them (the gate prefers these); those of
        children whose pid `first` picks (they hold the job's model) come first."""
        out = []
        for fd in internals.idle(self.pool, internals.pipes(self.pool)):
            if self._queued and self._busy_behind(fd):
                continue
            binding = self._binding(fd)
            if binding and binding != TAINTED:
                pid = getattr(internals.process_of(self.pool, fd), "pid", 0)
                out.append((not (first and first(pid)), tuple(devices_of_mask(binding))))
        return [devices for _, devices in sorted(out)]

    # -- routing ---------------------------------------------------------------------

    def schedule(self, ready_fds: list[int], *args: Any, **kwargs: Any) -> Any:
        outbound = internals.outbound(self.pool)
        if outbound and self._behind:
            self._write_behind(outbound, *args, **kwargs)
        ready = [fd for fd in ready_fds if not self._busy_behind(fd)] if self._queued else ready_fds
        idle = internals.idle(self.pool, ready)
        if not outbound or not idle:
            return self.original(ready, *args, **kwargs)
        for job in list(outbound):
            if not idle:
                break
            if str(getattr(job, "correlation_id", "")) in self._behind:
                continue  # only ever written to the child of the job it follows
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
            self._record(task_id, fd)
        return None

    # -- pipelining --------------------------------------------------------------------

    def _record(self, task_id: str, fd: int) -> None:
        proc = internals.process_of(self.pool, fd)
        if proc is not None and task_id not in self._moved_at_write:
            self._at[task_id] = (fd, int(getattr(proc, "pid", 0) or 0))

    def _busy_behind(self, fd: int) -> bool:
        """The child on `fd` has a pipelined job to run (its pid still the same)."""
        queued = self._queued.get(fd)
        if queued is None:
            return False
        proc = internals.process_of(self.pool, fd)
        if proc is None or int(getattr(proc, "pid", 0) or 0) != queued[0]:
            del self._queued[fd]
            return False
        return True

    def may_follow(self, task_id: str) -> bool:
        """Whether a job may be written behind running job `task_id`: it was written, not
        moved, to a child still alive with nothing else queued behind it."""
        at = self._at.get(task_id)
        if at is None or self._queued.get(at[0], (0, task_id))[1] != task_id:
            return False
        proc = internals.process_of(self.pool, at[0])
        return proc is not None and int(getattr(proc, "pid", 0) or 0) == at[1]

    def follow(self, task_id: str, ahead: str) -> None:
        """Write job `task_id` to the child of running job `ahead`, behind it."""
        self._behind[task_id] = ahead

    def handed_over(self, task_id: str) -> None:
        """The job ahead ended and this one holds its devices: route it as any job."""
        self._behind.pop(task_id, None)

    def _write_behind(self, outbound: Any, *args: Any, **kwargs: Any) -> None:
        for job in list(outbound):
            task_id = str(getattr(job, "correlation_id", ""))
            ahead = self._behind.get(task_id, "")
            at = self._at.get(ahead)
            if at is None or not self.may_follow(ahead) or internals.writing(self.pool, at[0]):
                continue  # it waits in the buffer: handed over, it is routed as any job
            fd = at[0]
            outbound.remove(job)
            outbound.appendleft(job)
            self._announce(fd, task_id)
            internals.write_behind(self.pool, fd, partial(self.original, [fd], *args, **kwargs))
            if job in outbound:
                continue
            self._behind.pop(task_id, None)
            self._written.add(task_id)
            self._queued[fd] = (at[1], task_id)
            self._at[task_id] = at
            self.pipelined += 1

    def write_now(self) -> None:
        """Route and write the waiting jobs to idle children now, as the loop's next poll
        would (the gate calls it when it dispatched a job: the job reaches its child
        without waiting for the rest of the loop's turn). A pipe that cannot take the
        whole job now gets the rest when the loop sees it writable, as on that path."""
        if not internals.outbound(self.pool):
            return
        try:
            self.schedule(internals.idle(self.pool, internals.pipes(self.pool)))
        except Exception as exc:  # the loop's own write path tries again at its next poll
            log.warning("ojs-ml: could not write a job to a pool child now: %r", exc)

    def _choose(self, job: Any, idle: list[int]) -> int | None:
        task_id = str(getattr(job, "correlation_id", ""))
        devices = self.devices_of(task_id)
        bindings = {fd: self._binding(fd) for fd in idle}
        if not devices:  # no GPUs: a fresh child first, then any
            fresh = [fd for fd in idle if not bindings[fd]]
            return (fresh or idle)[0]
        want = mask_of(devices)
        for fd in idle:
            if bindings[fd] == want:
                self.warm_hits += 1
                return fd
        moved_to = self._move_onto_warm(task_id, want, idle, bindings)
        if moved_to is not None:
            return moved_to
        for fd in idle:
            if not bindings[fd]:
                return fd
        self._retire_when_stuck(task_id, idle, bindings)
        return None

    def _move_onto_warm(
        self, task_id: str, want: int, idle: list[int], bindings: dict[int, int | None]
    ) -> int | None:
        """An idle child bound to other devices of the same count: move the job there."""
        for fd in idle:
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
        return None

    def _retire_when_stuck(
        self, task_id: str, idle: list[int], bindings: dict[int, int | None]
    ) -> None:
        """The child just freed may not have released its devices yet (the result and
        the release are handled in the same loop turn): wait a moment before retiring."""
        if len(self._stuck) > 10_000:  # revoked while waiting: never routed, never popped
            self._stuck.clear()
        since = self._stuck.setdefault(task_id, time.monotonic())
        if time.monotonic() - since > _RETIRE_AFTER_S:
            self._stuck.pop(task_id, None)
            self._retire_one(idle, bindings)

    def _announce(self, fd: int, task_id: str) -> None:
        """Tell the child, before it reads the job, which devices the job was moved to."""
        index = getattr(internals.process_of(self.pool, fd), "index", None)
        if index is not None:
            moved = self._moved.pop(task_id, 0)
            if moved:
                self._moved_at_write.add(task_id)
            self.table.announce(int(index), moved)

    def finished(self, task_id: str) -> None:
        """The gate released the job: forget it."""
        self._written.discard(task_id)
        self._moved.pop(task_id, None)
        self._behind.pop(task_id, None)
        self._moved_at_write.discard(task_id)
        at = self._at.pop(task_id, None)
        if at is not None and self._queued.get(at[0], (0, ""))[1] == task_id:
            del self._queued[at[0]]

    def _retire_one(self, idle: list[int], bindings: dict[int, int | None]) -> None:
        """No idle child can take the job: retire the least recently used bound one."""
        bound = [fd for fd in idle if bindings[fd]]
        if not bound:
            return
        fd = min(bound, key=lambda f: self.last_used.get(f, 0.0))
        proc = internals.process_of(self.pool, fd)
        if proc is None or getattr(proc, "_ojs_retiring", False):
            return
        proc._ojs_retiring = True
        self.retired += 1
        log.info("ojs-ml: retiring pool child %s (bound elsewhere) for a new device set",
                 getattr(proc, "pid", "?"))  # fmt: skip
        proc.terminate()
