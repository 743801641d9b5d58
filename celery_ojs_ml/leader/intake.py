"""The scheduler's intake: jobs published to the intake queue, into the pending set.

Key decisions:
* The intake queue is an ordinary broker queue; a message is acked only once
  its job is in the store, in one transaction per drained batch (or at the
  head of the pass's first reads), so a crash before that redelivers it.
* A message the scheduler cannot parse is refused (dead-lettered with the
  reason and recorded failed), never raised out of the consumer.
* A worker's wake-up (capacity freed) rides the same queue, so the loop has
  one place to block.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from celery_ojs_ml.store.deadletter import dead_letter
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.inbound import BadMessage, InboundCheck
from celery_ojs_ml.wire.records import job_record, republish_headers, stored_message

from .link import BrokerLink

log = logging.getLogger("celery_ojs_ml.leader.loop")

_PROPERTIES = ("correlation_id", "reply_to", "priority", "delivery_mode")

Arrival = tuple[str, dict[str, Any], dict[str, Any], Any]
"""(task id, pending record meta, stored message, broker message) of a read job."""


class Intake:
    """Read the intake queue; admit its jobs to the pending set (see module doc)."""

    def __init__(
        self,
        app: Any,
        store: OJSStore,
        book: PendingBook,
        check: InboundCheck,
        link: BrokerLink,
        heard: Callable[[bool], None],
    ) -> None:
        self.app = app
        self.store = store
        self.book = book
        self.check = check
        self.link = link
        self.heard = heard
        """Called on every message, True for a worker's wake-up (the loop's cue)."""
        self.arrivals: list[Arrival] = []
        """Jobs read, admitted in one batch after the drain (or with the first reads)."""
        self.late = False
        """The last admission ran after the pass's reads (`PassInputs.first_reads`)."""
        self.woken = False
        """A wake-up was read since the last `sit_out` began."""

    def connect(self) -> None:
        self.link.connect(self.on_message)

    def close(self) -> None:
        self.arrivals = []  # not acked: the broker redelivers them to the next leader
        self.link.close()

    def read(self, wait_s: float, batch: int) -> None:
        """Read what the intake holds into `arrivals`, waiting up to `wait_s` for the first."""
        reliable = self.link.reliable
        if reliable is None:
            try:
                self.link.conn.drain_events(timeout=wait_s)
                while len(self.arrivals) < batch:  # what is already there, without waiting
                    self.link.conn.drain_events(timeout=0)
            except TimeoutError:
                pass
            return
        deadline = time.monotonic() + wait_s
        while True:
            messages = reliable.pop(max(0.0, deadline - time.monotonic()))
            for message in messages:
                self.on_message(message)
            if len(messages) >= reliable.batch:
                deadline = 0.0  # more may be there: read on without waiting
            elif messages or time.monotonic() >= deadline:
                return
            if len(self.arrivals) >= batch:
                return

    def sit_out(self, gap_s: float, batch: int) -> None:
        """Wait out the gap between two passes reading the intake; a worker's wake-up
        (capacity freed, a job given back or started) ends it at once, arrivals do not."""
        self.woken = False
        deadline = time.monotonic() + gap_s
        while not self.woken and len(self.arrivals) < batch:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.read(left, batch)

    def admit(self) -> None:
        """Write the read jobs to the pending set in one transaction, then ack them."""
        batch, self.arrivals = self.arrivals, []
        if not batch:
            return
        self.book.admit_many([(task_id, meta, msg) for task_id, meta, msg, _ in batch])
        for *_, message in batch:  # acked only once stored: a crash before redelivers them
            message.ack()

    def admission(self, pipe: Any) -> Callable[[Any], None] | None:
        """Queue the read jobs' admission at the head of the pass's first reads
        (`pass_reads`): the reads after it see them, and the leader's hop from intake
        to assignment is a round trip shorter. The function returned takes its reply
        and acks the messages; None (nothing queued) where the store runs no Lua."""
        batch = self.arrivals
        jobs = [(task_id, meta, msg) for task_id, meta, msg, _ in batch]
        finish = self.book.admit_in(pipe, jobs) if batch else None
        if finish is None:
            return None
        self.arrivals = []

        def done(reply: Any) -> None:
            # The server did not hold the script (a new leader's first admission, a Redis
            # restart): `finish` admits them now, after the reads that were to see them.
            self.late = isinstance(reply, Exception)
            finish(reply)
            for *_, message in batch:  # acked only once stored: a crash before redelivers
                message.ack()

        return done

    def on_message(self, message: Any) -> None:
        """An intake message: a job to admit, or a worker's wake-up."""
        headers = dict(message.headers or {})
        headers.pop(h.GRANT, None)  # taken back from a grant's holder: admitted afresh,
        sent = headers.pop(h.GRANT_AT, None)  # in its place in first-come order
        wake = h.WAKE in headers
        self.heard(wake)
        if wake:
            self.woken = True
            message.ack()
            return
        task_id = headers.get("id")
        if not isinstance(task_id, str) or not task_id:
            log.error("ojs-ml: dropping an intake message without a task id: %r", headers)
            message.ack()
            return
        body = message.body if isinstance(message.body, bytes) else str(message.body).encode()
        try:
            if self.check.requirements(dict(headers)) is None:
                raise BadMessage(
                    "no ojs_class header: publish ML jobs through the OJSML(app) router"
                )
        except BadMessage as exc:
            self.refuse(task_id, headers, body, str(exc))
            message.ack()
            return
        meta = self._meta_of(headers, message, sent)
        self.arrivals.append((task_id, meta, _msg(message, headers, body), message))

    def _meta_of(self, headers: dict[str, Any], message: Any, sent: Any) -> dict[str, Any]:
        meta = pending_meta(headers, message.properties or {}, self.app.conf)
        if isinstance(sent, int | float) and not isinstance(sent, bool) and sent > 0:
            meta["submitted_at"] = min(float(sent), meta["submitted_at"])
        return meta

    def refuse(self, task_id: str, headers: dict[str, Any], body: bytes, reason: str) -> None:
        """A job no worker may run: dead-letter it and fail it, with the reason."""
        log.error("ojs-ml: refusing %s at intake: %s", task_id, reason)
        try:
            args, kwargs = json.loads(body)[:2]
        except Exception:
            args, kwargs = [], {}
        args = args if isinstance(args, list) else []
        kwargs = kwargs if isinstance(kwargs, dict) else {}
        kept = republish_headers(headers) if len(repr(headers)) < 65536 else {}
        record = job_record(task_id, headers.get("task"), args, kwargs, kept, retries=0)
        try:
            dead_letter(self.store, record, f"refused by the scheduler: {reason}")
            self.app.backend.mark_as_failure(task_id, BadMessage(reason), request=None)
        except Exception as exc:
            log.warning("ojs-ml: while refusing %s: %s", task_id, exc)


def _msg(message: Any, headers: dict[str, Any], body: bytes) -> dict[str, Any]:
    """The job's message as the pending record keeps it (delivered as it came)."""
    props = message.properties or {}
    kept = {k: props.get(k) for k in _PROPERTIES}
    return stored_message(body, message.content_type, message.content_encoding, headers, kept)


def pending_meta(headers: dict[str, Any], props: dict[str, Any], conf: Any) -> dict[str, Any]:
    """The pending record's `meta`: what the pass orders and backfills the job by."""
    limit = headers.get("ext_ml_timeout_seconds")
    if not isinstance(limit, int | float) or isinstance(limit, bool) or limit <= 0:
        # The task's hard limit (a soft one alone is no end: backfill needs a bound).
        limit = hard_limit(headers.get("timelimit"), conf)
    return {
        "task": headers.get("task"),
        "queue": headers.get(h.LOGICAL) or "celery",
        "band": headers.get(h.BAND) or "",
        "gpus": headers.get("ext_ml_gpu_count") or 0,
        "priority": props.get("priority") or 0,
        "submitted_at": time.time(),
        "time_limit_s": limit,
    }


def hard_limit(timelimit: Any, conf: Any) -> float | None:
    """The hard run-time limit Celery enforces on the job: the message's `timelimit`
    header (`[hard, soft]`), else `task_time_limit`; a soft limit alone is no end (a
    task may catch `SoftTimeLimitExceeded` and go on), so it is not returned."""
    hard = timelimit[0] if isinstance(timelimit, list | tuple) and timelimit else None
    for found in (hard, getattr(conf, "task_time_limit", None)):
        if isinstance(found, int | float) and not isinstance(found, bool) and found > 0:
            return float(found)
    return None
