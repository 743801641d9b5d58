"""Dynamic batching at the gate (`ml_batch`): requests of one task and one requirement
class that wait for the same kind of device set run as one call, on one allocation.

Key decisions:
* Batches form where the gate allocates, so the allocation authority stays in
  one place: the first request that gets an allocation heads a forming batch
  and keeps it; a request of its group that gets an allocation meanwhile
  gives it back and joins; held requests of the group join when the batch
  goes (`batch_groups` says which, and when). A batch is never split: one
  allocation, one device set, one warm pool child (`batch_runs`).
* The gate stays the safety net: capacity, fencing tokens, grants, holds and
  preemption decide for each request as before; batching only changes what
  happens once a request has an allocation (`takes`) and what its pool job
  carries (`BatchRuns.hand_over`).
* A forming batch holds its allocation for at most `max_wait_s`; requests that
  queued while the devices were busy go at once.
* The consumer reads up to the largest declared `max_size` further ahead (a
  QoS raise at each consumer start), so that a batch can fill from a worker's
  own queue (a grant's holder) and not only from what the prefetch window
  lets wait at the gate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery_ojs_ml.allocator import Allocation, Allocator
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.wire.batch import BatchOptions, options_of
from celery_ojs_ml.worker.batch_groups import (
    Forming,
    FormingBook,
    GroupKey,
    goes_now,
    group_key,
    take_waiting,
)
from celery_ojs_ml.worker.batch_runs import BatchRuns
from celery_ojs_ml.worker.running import Running

log = logging.getLogger("celery_ojs_ml.worker.core")


class Batcher:
    """Forms batches at the gate and starts them (see module doc).

    The gate calls `takes(req, alloc)` first thing when it would dispatch a request
    with an allocation, and `runs.hand_over(req, alloc)` just before the pool gets it.
    `gate` is the worker's `Gate`; what is used of it: `_dispatch`, `_try_alloc`,
    `_handle`, `leave_hold`, `_pump_soon`, `admission`, `preemptions`.
    """

    def __init__(
        self,
        consumer: Any,
        gate: Any,
        allocator: Allocator,
        running: Running,
        runs: BatchRuns,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.c, self.gate, self.allocator, self.running, self.runs = (
            consumer, gate, allocator, running, runs,
        )  # fmt: skip
        self.clock = clock
        self.book = FormingBook()
        self._options: dict[str, BatchOptions | None] = {}
        self._going: set[Any] = set()
        """Heads being dispatched by `go`: `takes` lets them through."""

    @classmethod
    def for_gate(cls, gate: Any, running: Running, assignments: Any, leases: Any) -> Batcher:
        """The batcher of `gate` (`MLWorker` builds one per consumer, and sets `gate.batching`)."""
        runs = BatchRuns(
            gate.c, gate.hostname, running, assignments, leases, gate.preemptions,
            gate._clear_pending, gate.refuse,
        )  # fmt: skip
        batcher = cls(gate.c, gate, gate.allocator, running, runs)
        gate.batching = batcher
        return batcher

    # -- declarations -----------------------------------------------------------------------

    def options(self, req: Any) -> BatchOptions | None:
        """The `ml_batch` declaration of a request's task (read once per task name)."""
        task = getattr(req, "task", None)
        name = str(getattr(task, "name", ""))
        if name not in self._options:
            try:
                self._options[name] = options_of(task)
            except ConfigError as exc:  # the app's finalize raised it already; run unbatched
                log.warning("ojs-ml: %s; its requests run one by one", exc)
                self._options[name] = None
        return self._options[name]

    def open(self, consumer: Any) -> None:
        """At every consumer start: raise its QoS by the largest declared `max_size`. A bad
        declaration stops the worker here, with the ConfigError naming it."""
        self.c = consumer
        found = [options_of(task) for task in list(consumer.app.tasks.values())]
        sizes = [o.max_size for o in found if o is not None]
        qos = getattr(consumer, "qos", None)
        if sizes and qos is not None:
            qos.increment_eventually(max(sizes))

    def close(self) -> None:
        """Consumer stop: forming batches give their allocation back; their messages are
        unacked, so the broker delivers them again, as it does held ones."""
        with self.running.lock:
            for forming in self.book.all():
                self.book.pop(forming.key)
                _cancel(forming.timer)
                self.allocator.free(forming.head)
            self._going.clear()
            self.runs.pending.clear()

    # -- forming --------------------------------------------------------------------------------

    def _key(self, req: Any) -> GroupKey | None:
        if self.options(req) is None:
            return None
        return group_key(str(req.name), req.request_dict)

    def takes(self, req: Any, alloc: Allocation) -> bool:
        """Whether batching takes over a request the gate would dispatch now (under the
        gate's lock): it joins a forming batch of its group, or heads a new one."""
        if req in self._going:
            self._going.discard(req)
            return False
        opts = self.options(req)
        key = None if opts is None else group_key(str(req.name), req.request_dict)
        if opts is None or key is None or opts.max_size < 2:
            return False
        forming = self.book.joinable(key)
        if forming is not None:
            self.allocator.free(req)  # it rides on the forming batch's allocation
            forming.followers.append(req)
            if forming.full:
                self.go(forming)
            self.gate._pump_soon()  # its allocation is free again
            return True
        now = self.clock()
        forming = Forming(key, req, alloc, opts.max_size, now + opts.max_wait_s)
        waiting = self._take_waiting(forming)
        if goes_now(forming, bool(waiting), now):
            self.go(forming)
        else:
            self.book.add(forming)
            forming.timer = self.c.timer.call_after(opts.max_wait_s, self._due, (key,))
        return True

    def _take_waiting(self, forming: Forming) -> list[Any]:
        """Held requests of the batch's group join it, in the hold queue's order."""
        held = [p.key for p in self.allocator.held()]
        found = take_waiting(held, forming.key, self._key, forming.room)
        for req in found:
            self.allocator.cancel(req)
            self.running.hold_until.pop(req, None)
            self.gate.leave_hold(req)
        forming.followers.extend(found)
        return found

    def _due(self, key: GroupKey) -> None:
        """A forming batch's wait is over: what waits of its group joins, then it goes."""
        with self.running.lock:
            forming = self.book.pop(key)
            if forming is None:
                return
            forming.timer = None
            self._take_waiting(forming)
            self.go(forming)

    def go(self, forming: Forming) -> None:
        """Start a batch: its head goes through the rest of the gate's dispatch, which hands
        the followers over (`BatchRuns.hand_over`). A head that is dropped there (a stale
        assignment) or was revoked meanwhile leaves its followers to the gate again."""
        if self.book.by_key.get(forming.key) is forming:
            self.book.pop(forming.key)
        _cancel(forming.timer)
        head, followers = forming.head, forming.followers
        if head.revoked():  # announced and acked by Celery; its allocation is free again
            self.allocator.free(head)
            self.again(followers)
            return
        self.runs.pending[head] = followers
        self._going.add(head)
        try:
            self.gate._dispatch(head, forming.alloc)
        except Exception as exc:  # as the gate ends a request it failed on
            log.exception("ojs-ml: the gate failed on %s, the head of a batch", head.id)
            self.allocator.free(head)
            self.gate.refuse(head, f"the worker's gate failed: {exc!r}")
        finally:
            self._going.discard(head)
            left = self.runs.pending.pop(head, None)
        if left:
            self.again(left)

    def again(self, reqs: list[Any]) -> None:
        """Requests of a batch whose head did not start: through the gate again, in order
        (the first gets the freed allocation and heads a batch of the others)."""
        gate = self.gate
        for req in reqs:
            headers = req.request_dict
            try:
                ml = gate.preemptions.cap(gate.admission.requirements(headers), headers)
                gate._handle(req, gate._try_alloc(req, ml))
            except Exception as exc:  # never out of the event loop
                log.exception("ojs-ml: could not place %s again after its batch", req.id)
                gate.refuse(req, f"the worker's gate failed: {exc!r}")


def _cancel(timer: Any) -> None:
    if timer is not None:
        timer.cancel()
