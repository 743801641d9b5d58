"""The gate's side of an assignment: start it while its token is current, else hand it back.

Responsibility: what the worker gate does with a message the fleet scheduler
delivered (header `ojs_assign`). The gate is the safety net (DESIGN decision
9): it still checks the fit and pins devices. Here it also makes sure that a
job runs at most once per assignment:
- fits now: the record goes `assigned` -> `started` in one transaction that
  checks the token; a stale copy (the assignment was taken back) is dropped;
- does not fit, but the scheduler planned a preemption (`ojs_victims`): the
  victims are asked to yield and the job is held; its record says until when;
- does not fit otherwise: the assignment is given back with the reason, and
  the scheduler places the job again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from celery.worker import state as worker_state

from celery_ojs_ml.allocator import Allocation, Allocator
from celery_ojs_ml.allocator.policy import is_victim
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.records import stored_message
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.preemption import Preemptions, grace_of
from celery_ojs_ml.worker.running import Running

log = logging.getLogger(__name__)
HEADER_ASSIGN = h.ASSIGN
HEADER_VICTIMS = h.VICTIMS
STORE_RETRY_S = 1.0
"""How long an assigned copy the gate could not claim (the store did not answer) waits
before it goes back to its queue: the gate tries again about once a second."""


def token_of(req: Any) -> str | None:
    """The assignment token of a scheduled message, or None (not from the scheduler)."""
    token = req.request_dict.get(HEADER_ASSIGN)
    return token if isinstance(token, str) and token else None


def victims_of(req: Any) -> tuple[str, ...]:
    """The task ids the scheduler planned to preempt for this job."""
    value = req.request_dict.get(HEADER_VICTIMS)
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


class Assignments:
    """Runs each assignment at most once, or hands it back to the scheduler (module doc)."""

    def __init__(
        self,
        hostname: str,
        settings: OJSMLSettings,
        allocator: Allocator,
        running: Running,
        preemptions: Preemptions,
        wake_scheduler: Callable[[], None],
    ) -> None:
        self.hostname, self.settings, self.allocator = hostname, settings, allocator
        self.running, self.preemptions, self.wake_scheduler = running, preemptions, wake_scheduler
        self.book: PendingBook = None  # type: ignore[assignment]
        self.lease_of: Callable[[str], Any] = lambda task_id: None
        self.finished: Callable[[Any], bool] = lambda req: False
        """Settles a copy whose job is done (`worker.finished.settle_copy`)."""
        self.to_intake: Callable[[Any, str], None] | None = None
        """Sends a copy back to the intake with its message (`Grants.give_back_granted`)."""
        self.later: Callable[[float, Callable[[], None]], Any] = lambda s, f: f()
        """Runs a call after a delay (the consumer's timer)."""

    def open(self, book: PendingBook, lease_of: Callable[[str], Any]) -> None:
        """At every consumer start: the pending set and the lease book to read."""
        self.book, self.lease_of = book, lease_of

    def may_start(self, req: Any, alloc: Allocation) -> bool:
        """Claim the assignment for this run; False (message dropped) when it is stale, or
        when the job committed its final checkpoint in an earlier run (`worker.finished`:
        its recorded result is stored and the message acked)."""
        token = token_of(req)
        if token is not None and not self._claim(req, token):
            return False
        if self.finished(req):
            self.allocator.free(req)
            return False
        return True

    def _claim(self, req: Any, token: str) -> bool:
        try:
            outcome = self.book.start(req.id, token, self.hostname)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # Not a bad message: the broker keeps it, and it comes back once the store does.
            log.warning(
                "ojs-ml: the store does not answer (%s); %s goes back to its queue in %s s",
                *(exc, req.id, STORE_RETRY_S),
            )
            self.allocator.free(req)
            self.later(STORE_RETRY_S, lambda: requeue(req))
            return False
        if outcome == "ok":  # a start a failover undid would let the leader place it again
            self.book.store.replicated()
        if outcome == "again" and not self._alive(req.id):
            log.warning(
                "ojs-ml: %s is delivered again and holds no lease; running it again", req.id
            )
            return True
        if outcome in ("stale", "again"):
            log.warning("ojs-ml: %s was assigned elsewhere since; dropping this copy", req.id)
            self.allocator.free(req)
            drop(req)
            return False
        if outcome == "unknown":
            log.warning("ojs-ml: the store has no record of %s's assignment; running it", req.id)
        return True

    def hold_for_victims(self, req: Any, grace_s: float) -> None:
        """Tell the scheduler this worker holds the job while its victims yield."""
        until = time.time() + grace_s + self.settings.max_hold_s
        try:
            self.book.hold(req.id, until)
        except Exception as exc:
            log.warning("ojs-ml: could not record the hold of %s: %s", req.id, exc)

    def give_back(self, req: Any, reason: str) -> None:
        """The assignment cannot run here: back to the scheduler with the reason; drop the
        copy. A copy delivered *again* (its run started here, then died before its lease
        was written, and the broker restored the message) is the job's only copy when no
        lease shows that run alive: it goes back to the pending set with this message, or,
        where the store has no record of the job at all, to the intake (`to_intake`)."""
        token = token_of(req)
        assert token is not None
        why = f"assigned to {self.hostname}, which gave it back: {reason}"
        book = self.book
        try:
            if not book.give_back(req.id, token, why) and not self._alive(req.id):
                if book.give_back(req.id, token, why, msg=message_of(req)):
                    log.warning(
                        "ojs-ml: %s was delivered again after its run died unleased", req.id
                    )
                elif self.to_intake is not None and "state" not in (book.get(req.id) or {}):
                    # the store lost the record (it restarted without it): the copy is the job
                    log.warning("ojs-ml: the store has no record of %s; back to the intake", req.id)
                    self.to_intake(req, why)
                    self.wake_scheduler()
                    return
        except Exception as exc:  # the scheduler takes it back after the assignment timeout
            log.warning("ojs-ml: could not give %s back: %s", req.id, exc)
        log.info("ojs-ml: gave %s back to the scheduler: %s", req.id, reason)
        drop(req)
        self.wake_scheduler()

    def _alive(self, task_id: str) -> bool:
        """Whether the first run of a copy delivered again may still be running: it holds
        a lease, or it runs here (its lease write failed, so the broker kept its message
        unacked and restored it after the visibility timeout)."""
        return task_id in self.running.requests or self.lease_of(task_id) is not None
        return task_id in self.running.requests or self.lease_of(task_id) is not None

    def preempt_planned(self, req: Any, victims: tuple[str, ...]) -> float | None:
        """Ask the victims the scheduler chose to yield; the longest grace, or None."""
        band = band_of_request(req)
        allow = self.settings.allow_on_demand_preemption
        planned = [
            a
            for a in self.allocator.allocations()
            if getattr(a.key, "id", None) in victims and is_victim(a, band, allow_on_demand=allow)
        ]
        if not planned:
            return None
        longest = 0.0
        for alloc in planned:
            grace = grace_of(alloc.key)
            longest = max(longest, grace)
            if alloc.key not in self.preemptions:
                self.preemptions.preempt(alloc.key, grace)
        return longest


_GATE_HEADERS = h.GATE
"""What the gate adds to a request's headers when it dispatches it (`Gate._dispatch`)."""


def message_of(req: Any) -> dict[str, Any]:
    """A delivered request as the pending set stores a message (`Intake._on_message`)."""
    skip = (*h.DELIVERY, *_GATE_HEADERS)
    headers = {k: v for k, v in req.request_dict.items() if k not in skip}
    properties = {
        "correlation_id": req.correlation_id,
        "reply_to": req.reply_to,
        "priority": (req.delivery_info or {}).get("priority"),
    }
    return stored_message(req.body, req.content_type, req.content_encoding, headers, properties)


def requeue(req: Any) -> None:
    """Put this copy back on its queue, to be gated again."""
    worker_state.task_ready(req)
    req.reject(requeue=True)


def drop(req: Any) -> None:
    """Remove this copy of the message (the store holds the job)."""
    worker_state.task_ready(req)
    req.reject(requeue=False)


def band_of_request(req: Any) -> str:
    """The band the router put on the message (`ojs_band`)."""
    value = req.request_dict.get(h.BAND)
    return value if isinstance(value, str) else "on-demand"
