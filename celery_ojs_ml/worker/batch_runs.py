"""A batch's run in the worker's main process: hand the other requests to the first's
pool job, then end each of them as its own job.

Key decisions:
* One pool job runs the batch: the first request's (its head's). Everything the
  pool, the warm router, time limits, fencing and preemption do, they do to it,
  on the batch's one allocation. The others (followers) never reach the pool;
  they travel in the head's `h.BATCH` header (`wire.batch`).
* Each follower is still a job of its own here: its assignment is claimed (by
  its token), it gets its own lease (written before its message is acked, so a
  crash re-publishes it alone) and `ojs-started` and `task-started` events, and
  it ends in its own state. The batch's devices are recorded once, on the
  head's lease: a follower's lease records none, so the scheduler counts the
  allocation once.
* How a follower ends follows how the head's pool job ended: the child stored
  its result or failure (`child.batch`) when the body ran; a preempted batch
  re-publishes every follower as a preempted job; a lost child or a hard time
  limit fails each follower as Celery fails a job whose child died.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from billiard.exceptions import Terminated, WorkerLostError
from celery.worker import state as worker_state

from celery_ojs_ml import celery_internals as internals
from celery_ojs_ml.allocator import Allocation
from celery_ojs_ml.checkpoint.preempt import Preempted
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.batch import batch_record
from celery_ojs_ml.worker.assigned import Assignments
from celery_ojs_ml.worker.lease_keeping import LeaseKeeper
from celery_ojs_ml.worker.preemption import Preemptions
from celery_ojs_ml.worker.running import Running
from celery_ojs_ml.worker.telemetry import started as started_event

log = logging.getLogger("celery_ojs_ml.worker.core")
RAN, PREEMPTED, LOST, TIMED_OUT = "ran", "preempted", "lost", "timed out"


@dataclass(slots=True)
class Run:
    """A batch handed to the pool: its head, its followers, and how it ended."""

    head: Any
    followers: list[Any]
    ended: str | None = None
    exc_info: Any = None
    timeout: float = 0.0
    done: bool = False


class BatchRuns:
    """Hand a batch to its head's pool job and end each follower (module doc)."""

    def __init__(
        self,
        consumer: Any,
        hostname: str,
        running: Running,
        assignments: Assignments,
        leases: LeaseKeeper,
        preemptions: Preemptions,
        clear_pending: Callable[[str], None],
        refuse: Callable[[Any, str], None],
    ) -> None:
        self.c, self.hostname, self.running = consumer, hostname, running
        self.assignments, self.leases, self.preemptions = assignments, leases, preemptions
        self.clear_pending, self.refuse = clear_pending, refuse
        self.pending: dict[Any, list[Any]] = {}
        """Head -> the followers its batch carries, from the batch's start to its hand-over."""
        self.calls = 0
        """Batched calls handed to the pool (a call of one request is not counted)."""
        self.requests = 0
        """The requests those calls carried."""

    def hand_over(self, head: Any, alloc: Allocation) -> None:
        """Called by the gate just before the head goes to the pool (its own assignment
        claimed, its lease taken): claim the followers, put them in its headers."""
        followers = self.pending.pop(head, None)
        if not followers:
            return
        claimed = [f for f in followers if self._claimed(f, alloc)]
        if not claimed:
            return
        members = [_member(f) for f in claimed]
        head.request_dict[h.BATCH] = batch_record(members, internals.task_events_on(self.c))
        self.calls += 1
        self.requests += 1 + len(claimed)
        self._wrap(Run(head, claimed))

    def _claimed(self, req: Any, alloc: Allocation) -> bool:
        try:
            return self._claim(req, alloc)
        except Exception as exc:  # as the gate ends a request it failed on
            log.exception("ojs-ml: could not start %s in a batch", req.id)
            self.refuse(req, f"the worker's gate failed: {exc!r}")
            return False

    def _claim(self, req: Any, alloc: Allocation) -> bool:
        """Start a follower as its own job: False (and dropped) when it was revoked or its
        assignment is stale, as the gate drops a head."""
        if req.revoked():  # Celery announced it REVOKED and acked it
            return False
        if not self.assignments.may_start(req, alloc):
            return False
        headers = req.request_dict
        headers[h.NODE] = self.hostname
        self.running.requests[req.id] = req
        if headers.get(h.PENDING):
            self.clear_pending(req.id)
        self.leases.take_lease(req, _riding(req, alloc))
        started_event(self.c, req.id, headers)
        return True

    # -- the head's callbacks ---------------------------------------------------------------

    def _wrap(self, run: Run) -> None:
        """Wrap the head's pool callbacks (outermost: the gate's release runs inside)."""
        head = run.head
        accepted, succeeded = head.on_accepted, head.on_success
        failed, timed_out = head.on_failure, head.on_timeout

        def on_accepted(pid: int, time_accepted: float) -> Any:
            try:
                return accepted(pid, time_accepted)
            finally:
                for req in run.followers:  # `task-started`, active, the child's pid
                    req.on_accepted(pid, time_accepted)

        def on_success(*args: Any, **kwargs: Any) -> Any:
            try:
                return succeeded(*args, **kwargs)
            finally:
                self.finish(run)

        def on_failure(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            run.ended, run.exc_info = self._ending(head, exc_info), exc_info  # before the release
            try:
                return failed(exc_info, *args, **kwargs)
            finally:
                self.finish(run)

        def on_timeout(soft: bool, timeout: float) -> Any:
            try:
                return timed_out(soft, timeout)
            finally:
                if not soft:
                    run.ended, run.timeout = TIMED_OUT, timeout
                    self.finish(run)

        head.on_accepted, head.on_success = on_accepted, on_success
        head.on_failure, head.on_timeout = on_failure, on_timeout

    def _ending(self, head: Any, exc_info: Any) -> str:
        """How the head's pool job failed: preempted, its child lost, or the body ran."""
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)
        if isinstance(exc, BaseException) and self.preemptions.yielded(head, exc):
            return PREEMPTED
        if isinstance(exc, Preempted):
            return PREEMPTED
        if isinstance(exc, Terminated | WorkerLostError):
            return LOST
        return RAN

    # -- ending the followers -----------------------------------------------------------------

    def finish(self, run: Run) -> None:
        """End every follower of a batch once (a failed head's `on_success` calls its
        `on_failure`: both end here)."""
        if run.done:
            return
        run.done = True
        run.head.__dict__.pop("on_accepted", None)  # the closure holds the head
        for req in run.followers:
            try:
                self._end(req, run)
            except Exception:  # one follower's end never strands the others
                log.exception("ojs-ml: could not end %s, a request of a batch", req.id)
            finally:
                self.release(req)

    def _end(self, req: Any, run: Run) -> None:
        if req in self.running.fenced:  # its lease was taken over: the copy elsewhere counts
            self.running.fenced.discard(req)
            worker_state.task_ready(req)
            return
        exc = getattr(run.exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)
        if run.ended == PREEMPTED:
            why = exc if isinstance(exc, BaseException) else Preempted(req.id)
            self.preemptions.requeue(req, why)
        elif run.ended == LOST:
            req.on_failure(run.exc_info)  # FAILURE (WorkerLostError), as Celery ends the head
        elif run.ended == TIMED_OUT:
            req.on_timeout(False, run.timeout)
        else:  # the body ran: the child stored this request's result or failure
            worker_state.task_ready(req)

    def release(self, req: Any) -> None:
        """A follower ended: release its lease; ack a message whose lease was not written."""
        running = self.running
        with running.lock:
            task_id: str = req.id
            if running.requests.get(task_id) is req:
                del running.requests[task_id]
            running.fenced.discard(req)
            token = running.tokens.pop(req, None)
            unacked = running.unacked.pop(req, False)
        if token is not None:
            self.leases.release_lease(req.id, token)
        if unacked:
            self.leases.ack(req)


def _riding(req: Any, alloc: Allocation) -> Allocation:
    """A follower's lease allocation: none of its own (the head's lease holds the batch's)."""
    return replace(
        alloc, key=req, task_id=req.id, devices=(), gpu_milli=0, cpu_cores=0.0, memory_gb=0.0,
        tpu_chips=0,
    )  # fmt: skip


def _member(req: Any) -> dict[str, Any]:
    """A follower as the child reads it: its headers, arguments and embedded callbacks."""
    return {**req.request_dict, **internals.request_embed(req)}
