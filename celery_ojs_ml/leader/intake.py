"""The scheduler's intake: jobs published to the intake queue, into the pending set.

A mixin of `scheduling.FleetScheduler`, split out of it to keep modules small;
every attribute below is set by `FleetScheduler.__init__`.

Key decisions (see `scheduling`'s module doc):
* The intake queue is an ordinary broker queue; a message is acked only once
  its job is in the store, in one transaction per drained batch, so a crash
  before that redelivers it.
* A message the scheduler cannot parse is refused (dead-lettered with the
  reason and recorded failed), never raised out of the consumer.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from kombu import Consumer, Producer  # type: ignore[attr-defined]

from celery_ojs_ml.allocator.policy import with_preemption_limits
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.store import broker as redis_intake
from celery_ojs_ml.store.broker import RedisIntake
from celery_ojs_ml.store.deadletter import dead_letter
from celery_ojs_ml.store.grants import HEADER_GRANT, HEADER_GRANT_AT
from celery_ojs_ml.store.leases import republish_headers
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.inbound import Admission, BadMessage
from celery_ojs_ml.wire.queues import ml_queue
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.preemption import policy_of, preemptions_of
from celery_ojs_ml.worker.setup import hard_time_limit

log = logging.getLogger("celery_ojs_ml.leader.loop")

HEADER_WAKE = redis_intake.WAKE_HEADER
_PROPERTIES = ("correlation_id", "reply_to", "priority", "delivery_mode")
_POP_BATCH = 64
"""Most messages the Redis intake moves per round trip."""


class Intake:
    """Drain the intake queue into the pending set (see module doc)."""

    app: Any
    settings: OJSMLSettings
    store: OJSStore
    book: PendingBook
    admission: Admission
    intake: str
    _intake: list[tuple[str, dict[str, Any], dict[str, Any], Any]]
    _admitted_late: bool
    _conn: Any
    _consumer: Any
    _producer: Any
    _events: Any
    _dirty: bool
    _woken: bool
    _lane: Any
    _declared: set[str]
    _reliable: RedisIntake | None

    def _read(self, wait_s: float, batch: int) -> None:
        """Read what the intake holds into `_intake`, waiting up to `wait_s` for the first."""
        reliable = self._reliable
        if reliable is None:
            try:
                self._conn.drain_events(timeout=wait_s)
                while len(self._intake) < batch:  # what is already there, without waiting
                    self._conn.drain_events(timeout=0)
            except TimeoutError:
                pass
            return
        deadline = time.monotonic() + wait_s
        while True:
            messages = reliable.pop(max(0.0, deadline - time.monotonic()))
            for message in messages:
                self._on_message(message)
            if len(messages) >= reliable.batch:
                deadline = 0.0  # more may be there: read on without waiting
            elif messages or time.monotonic() >= deadline:
                return
            if len(self._intake) >= batch:
                return

    def _sit_out(self, gap_s: float, batch: int) -> None:
        """Wait out the gap between two passes reading the intake; a worker's wake-up
        (capacity freed, a job given back or started) ends it at once, arrivals do not."""
        self._woken = False
        deadline = time.monotonic() + gap_s
        while not self._woken and len(self._intake) < batch:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._read(left, batch)

    def _admit(self) -> None:
        """Write the drained jobs to the pending set in one transaction, then ack them."""
        batch, self._intake = self._intake, []
        if not batch:
            return
        self.book.admit_many([(task_id, meta, msg) for task_id, meta, msg, _ in batch])
        for *_, message in batch:  # acked only once stored: a crash before redelivers them
            message.ack()

    def _admission(self, pipe: Any) -> Callable[[Any], None] | None:
        """Queue the drained jobs' admission at the head of the pass's first reads
        (`pass_reads`): the reads after it see them, and the leader's hop from intake
        to assignment is a round trip shorter. The function returned takes its reply
        and acks the messages; None (nothing queued) where the store runs no Lua."""
        batch = self._intake
        jobs = [(task_id, meta, msg) for task_id, meta, msg, _ in batch]
        finish = self.book.admit_in(pipe, jobs) if batch else None
        if finish is None:
            return None
        self._intake = []

        def done(reply: Any) -> None:
            # The server did not hold the script (a new leader's first admission, a Redis
            # restart): `finish` admits them now, after the reads that were to see them.
            self._admitted_late = isinstance(reply, Exception)
            finish(reply)
            for *_, message in batch:  # acked only once stored: a crash before redelivers
                message.ack()

        return done

    def _settle(self) -> None:
        """Take the acked messages off the Redis intake's processing list."""
        if self._reliable is not None:
            self._reliable.done()

    def _connect(self) -> None:
        if self._conn is not None:
            return
        conn = self.app.connection_for_write()
        conn.ensure_connection(max_retries=1)
        channel = conn.channel()
        queue = ml_queue(self.intake)
        consumer: Any = Consumer(channel, queues=[queue], on_message=self._on_message)  # type: ignore[no-untyped-call]
        self._conn, self._consumer = conn, consumer
        if redis_intake.supports(channel):  # read the lists ourselves: see `redis_intake`
            self._reliable = RedisIntake(channel, self.intake, _POP_BATCH)
            for message in self._reliable.recover():
                self._on_message(message)
        else:
            consumer.qos(prefetch_count=256)
            consumer.consume()
        self._producer = Producer(conn.channel())  # type: ignore[no-untyped-call]
        self._direct = redis_intake.direct_channel(self.app, self.intake, self._producer.channel)
        self._declared = set()

    def _close(self) -> None:
        conn, self._conn, self._consumer, self._producer = self._conn, None, None, None
        self._direct = self._events = self._lane = None
        self._intake = []  # not acked: the broker redelivers them to the next leader
        reliable, self._reliable = self._reliable, None
        if reliable is not None:
            reliable.close()  # what it took and did not settle waits in its processing list
        if conn is not None:
            try:
                conn.release()
            except Exception as exc:
                log.debug("ojs-ml: closing the scheduler connection: %s", exc)

    def _on_message(self, message: Any) -> None:
        """An intake message: a job to admit, or a worker's wake-up."""
        headers = dict(message.headers or {})
        headers.pop(HEADER_GRANT, None)  # taken back from a grant's holder: admitted afresh,
        sent = headers.pop(HEADER_GRANT_AT, None)  # in its place in first-come order
        self._dirty = True
        if HEADER_WAKE in headers:
            self._woken = True
            self._lane = None  # capacity changed: the next arrival takes a full pass
            message.ack()
            return
        task_id = headers.get("id")
        if not isinstance(task_id, str) or not task_id:
            log.error("ojs-ml: dropping an intake message without a task id: %r", headers)
            message.ack()
            return
        body = message.body if isinstance(message.body, bytes) else str(message.body).encode()
        try:
            if self.admission.requirements(dict(headers)) is None:
                raise BadMessage(
                    "no ojs_class header: publish ML jobs through the OJSML(app) router"
                )
        except BadMessage as exc:
            self._refuse(task_id, headers, body, str(exc))
            message.ack()
            return
        props = message.properties or {}
        msg = {
            "body": base64.b64encode(body).decode(),
            "content_type": message.content_type,
            "content_encoding": message.content_encoding,
            "headers": headers,
            "properties": {k: props[k] for k in _PROPERTIES if props.get(k) is not None},
        }
        meta = self._meta(headers, props)
        if isinstance(sent, int | float) and not isinstance(sent, bool) and sent > 0:
            meta["submitted_at"] = min(float(sent), meta["submitted_at"])
        self._intake.append((task_id, meta, msg, message))

    def _refuse(self, task_id: str, headers: dict[str, Any], body: bytes, reason: str) -> None:
        """An intake message no worker may run: dead-letter it and fail it, with the reason."""
        log.error("ojs-ml: refusing %s at intake: %s", task_id, reason)
        try:
            args, kwargs = json.loads(body)[:2]
        except Exception:
            args, kwargs = [], {}
        record = {
            "task_id": task_id,
            "name": headers.get("task"),
            "args": args if isinstance(args, list) else [],
            "kwargs": kwargs if isinstance(kwargs, dict) else {},
            "headers": republish_headers(headers) if len(repr(headers)) < 65536 else {},
            "retries": 0,
        }
        try:
            dead_letter(self.store, record, f"refused by the scheduler: {reason}")
            self.app.backend.mark_as_failure(task_id, BadMessage(reason), request=None)
        except Exception as exc:
            log.warning("ojs-ml: while refusing %s: %s", task_id, exc)

    def _meta(self, headers: dict[str, Any], props: dict[str, Any]) -> dict[str, Any]:
        limit = headers.get("ext_ml_timeout_seconds")
        if not isinstance(limit, int | float) or isinstance(limit, bool) or limit <= 0:
            # The task's hard limit (a soft one alone is no end: backfill needs a bound).
            limit = hard_time_limit(headers.get("timelimit"), None, self.app.conf)
        return {
            "task": headers.get("task"),
            "queue": headers.get("ojs_logical_queue") or "celery",
            "band": headers.get("ojs_band") or "",
            "gpus": headers.get("ext_ml_gpu_count") or 0,
            "priority": props.get("priority") or 0,
            "submitted_at": time.time(),
            "time_limit_s": limit,
        }

    # -- one pass -----------------------------------------------------------------------------

    def parse(self, headers: Any) -> MLRequirements | None:
        """The requirements of a job's headers, validated with the app's bounds."""
        try:
            return self.admission.requirements(dict(headers))
        except BadMessage as exc:
            log.error("ojs-ml: the scheduler cannot parse a job: %s", exc)
            return None

    def parse_running(self, headers: Any) -> MLRequirements | None:
        """The requirements of a running job's lease headers."""
        try:
            req = self.admission.parse(dict(headers))
            return with_preemption_limits(
                req,
                policy=policy_of(headers),
                preemptions=preemptions_of(headers),
                max_preemptions=self.settings.max_preemptions,
            )
        except BadMessage as exc:
            log.error("ojs-ml: the scheduler cannot parse a running job: %s", exc)
            return None
