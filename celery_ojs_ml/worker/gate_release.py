"""The gate's end of a job: free its allocation, start the held jobs that fit, then wake.

Key decisions:
* Devices are freed from instance-level `on_success`/`on_failure`/`on_timeout`
  wrappers keyed by the Request object, then held jobs are pumped.
* A release that leaves held jobs pumps at once, and the pump hands what it
  started to the warm router to be written to its child there and then
  (`Router.write_now`), before the leader's wake-up (the advertisement and its
  wake message) is built: deferred to the loop's next turn, the pump could run
  after the wake-up, and the write waited for the loop's next poll. A release
  with nothing held pumps on the next turn (one pump serves every release of a
  turn).
* No round trip sits between a job's end and the start of the held job: the lease
  release is queued on the lease writer (`LeaseWriter.release`, batched), and the
  finished job's message, when it is still to ack (it ended before its lease was
  due, or its lease could not be written), is acked after the pump. Either way the
  job ended before its message is acked, as before: a crash in between redelivers
  the message, for one pump longer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

from celery_ojs_ml.allocator import Allocation, Allocator
from celery_ojs_ml.allocator.model import rank
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.wire.headers import PREFETCH
from celery_ojs_ml.wire.labels import job_labels
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.assigned import Assignments, token_of
from celery_ojs_ml.worker.granted import Grants
from celery_ojs_ml.worker.preemption import Preemptions
from celery_ojs_ml.worker.running import Running

log = logging.getLogger("celery_ojs_ml.worker.core")

_WRAPPED = ("on_success", "on_failure", "on_timeout")
"""The request's callbacks `_dispatch` wraps: closures that hold the request."""


class GateRelease:
    """The release, pump and hold-expiry half of `gate.Gate` (see module doc)."""

    c: Any
    settings: OJSMLSettings
    allocator: Allocator
    lock: threading.RLock
    running: Running
    requests: dict[str, Any]
    devices_by_id: dict[str, tuple[int, ...]]
    hold_until: dict[Any, float]
    preemptions: Preemptions
    grants: Grants
    assignments: Assignments
    router: Any
    _pump_due: bool
    _pumping: bool
    """A pump is running: a release inside it (a dispatch that failed) pumps later."""

    _release_lease: Callable[[str, str, list[Any]], None]
    _ack: Callable[[Any], None]
    wake_scheduler: Callable[[], None]
    resubscribe: Callable[[], None]

    pipeline: Any = None
    """`pipelining.Pipeline`, or None where it is off."""

    def _dispatch(self, req: Any, alloc: Allocation) -> Any: ...

    def _account(self, req: Any, alloc: Allocation) -> None: ...

    def follow(self, req: Any, ml: MLRequirements, *, held: bool = False) -> Any: ...

    def _releasing(self, req: Any, original: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                self.release(req)

        return wrapped

    def _timeout_releasing(self, req: Any, original: Any) -> Any:
        def wrapped(soft: bool, timeout: float) -> Any:
            try:
                return original(soft, timeout)
            finally:
                if not soft:
                    self.release(req)

        return wrapped

    def release(self, req: Any) -> None:
        """Free a finished job's allocation, start held jobs that now fit, then wake the
        leader (unless the release is quiet: `grants.quiet_release`)."""
        self.preemptions.finished(req)
        self.devices_by_id.pop(req.id, None)
        if self.router is not None:
            self.router.finished(req.id)
        self.requests.pop(req.id, None)
        _unwrap(req)
        running = self.running
        with self.lock:
            running.fenced.discard(req)
            running.stopping.discard(req)
            if not self._free_or_hand_over(req):
                return
            token = running.tokens.pop(req, None)
        acks: list[Any] = []  # acked after the pump: each ack is a broker round trip
        if token is not None:
            self._release_lease(req.id, token, acks)  # the ack of a job without a lease
        if running.unacked.pop(req, False):
            acks.append(req)  # its lease could not be written: the message held it
        log.debug("ojs-ml: released %s", req.id)
        if self.allocator.held_keys() and not self._pumping:
            self.pump()  # now: the held job is written to its child before the wake-up
            self._follow_held()
        else:
            self._pump_soon()
        for done in acks:
            self._ack(done)
        # After the pump: the advertisement then already counts the job it started.
        with self.lock:
            quiet = self.grants.quiet_release(req) or self.ahead_enough()
        if not quiet:
            self.wake_scheduler()

    def ahead_enough(self) -> bool:
        """Whether at least half of `ojs_ml_prefetch` (rounded up) jobs the scheduler sent
        ahead still wait here, held or written behind a running job: a job's end or start
        then needs no wake-up (what it freed goes to them; the scheduler is woken to send
        more once they run low, and passes on its interval anyway)."""
        want = (self.settings.prefetch + 1) // 2
        if want < 1:
            return False
        ahead = len(self.pipeline.followers) if self.pipeline is not None else 0
        for key in self.allocator.held_keys():
            headers = getattr(key, "request_dict", None) or {}
            ahead += bool(headers.get(PREFETCH))
            if ahead >= want:
                return True
        return ahead >= want

    def _free_or_hand_over(self, req: Any) -> bool:
        """Free an ended job's allocation, or hand it to the job written behind it
        (`pipelining`); False when it held none."""
        pipeline = self.pipeline
        found = None if pipeline is None else pipeline.follower_of(req.id)
        if found is None:
            freed = self.allocator.free(req)
            if freed is not None and pipeline is not None:
                pipeline.ended(req, freed)
            return freed is not None
        follower, ml = found
        labels = job_labels(follower.name, follower.request_dict)
        moved = self.allocator.hand_over(req, follower, follower.id, ml, labels=labels)
        pipeline.router.handed_over(follower.id)
        if moved is None:  # its needs no longer fit: it runs, unaccounted (never expected)
            log.error("ojs-ml: %s was written behind %s but cannot take its devices",
                      follower.id, req.id)  # fmt: skip
            return self.allocator.free(req) is not None
        pipeline.ended(req, moved[0])
        self._account(follower, moved[1])
        held = self.allocator.held()
        if held and rank(held[0].band) > rank(moved[1].band):  # it waits for these devices
            self.preemptions.make_room(held[0].req, held[0].band)
        return True

    def _follow_held(self) -> None:
        """After a pump: the first held job may follow a running job (`pipelining`)."""
        if self.pipeline is None:
            return
        with self.lock:
            held = self.allocator.held()
            if not held or held[0].key in self.grants.granted_held:
                return
            followed = self.follow(held[0].key, held[0].req, held=True)
        if followed and self.router is not None:
            self.router.write_now()

    def _pump_soon(self) -> None:
        """`pump` on the event loop's next turn (one pump serves every release of a
        turn), or now where there is no loop (a thread other than the loop's)."""
        hub = getattr(self.c, "hub", None)
        if hub is not None and threading.current_thread() is threading.main_thread():
            if not self._pump_due:
                self._pump_due = True
                hub.call_soon(self.pump)
        else:
            self.pump()

    def pump(self) -> None:
        """Start held jobs that fit now, in band, priority and FIFO order (granted ones
        only while their grant holds: `recheck_grants`), and write them to their warm
        children at once (`Router.write_now`)."""
        if self.grants.granted_held:
            self.grants.recheck_grants()
        with self.lock:
            self._pump_due, self._pumping, started = False, True, 0
            try:
                for alloc in self.allocator.pump():
                    req: Any = alloc.key
                    self.hold_until.pop(req, None)
                    if req in self.grants.granted_held:
                        self.grants.granted_started = time.monotonic()
                    self.leave_hold(req)
                    if req.revoked():
                        self.allocator.free(req)
                        continue
                    self._dispatch(req, alloc)
                    started += 1
            finally:
                self._pumping = False
            self.resubscribe()
        if started and self.router is not None:
            self.router.write_now()

    def leave_hold(self, req: Any) -> None:
        granted_held = self.grants.granted_held
        if req in granted_held:  # held inside the prefetch limit (`hold_granted`)
            granted_held.discard(req)
            return
        self.c.qos.decrement_eventually()

    def _requeue(self, req: Any) -> None:
        worker_state.task_ready(req)
        req.reject(requeue=True)

    def expire_holds(self) -> None:
        """Requeue messages held longer than `ojs_ml_max_hold_s` (well below broker timeouts);
        give back granted ones held longer than `ojs_ml_grant_wait_s` (`expire_granted`)."""
        self.grants.expire_granted()
        with self.lock:
            now = time.monotonic()
            for pending in self.allocator.expired(self.settings.max_hold_s):
                req: Any = pending.key
                if self.hold_until.get(req, 0.0) > now:
                    self.allocator.hold(pending)  # still waiting for its victims to yield
                    continue
                self.hold_until.pop(req, None)
                if req in self.grants.granted_held:
                    self.leave_hold(req)
                    self.grants.give_back_granted(req, f"held too long: {pending.reason}")
                    continue
                self.leave_hold(req)
                if token_of(req) is not None:
                    self.assignments.give_back(req, f"held too long: {pending.reason}")
                    continue
                log.info("ojs-ml: %s held too long (%s); requeueing", req.id, pending.reason)
                self._requeue(req)
            if not self.allocator.held():
                self.resubscribe()


def _unwrap(req: Any) -> None:
    """Drop a finished request's wrapped callbacks. Each closure holds the request that
    holds it: a reference cycle that kept the request, its message and its promises
    alive until the cyclic collector ran (a gen-0 collection every few jobs in a
    burst). The pool already holds the callbacks it will call."""
    found = getattr(req, "__dict__", None)
    if found is not None:
        for name in _WRAPPED:
            found.pop(name, None)
