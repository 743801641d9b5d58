"""Delivering a pass's decisions: assignments to workers' queues, annotations, events.

A mixin of `scheduling.FleetScheduler`, split out of it to keep modules small;
every attribute below is set by `FleetScheduler.__init__`.

Key decisions (see `scheduling`'s module doc):
* An assignment is recorded in the store with a fresh token before its
  message is published to `<prefix>.ml.w.<worker>`, the one ML queue that
  worker consumes, as the job's own Celery message plus the token.
* A pass's deliveries go out in one kombu publish batch (one pipeline on
  Redis); a leader that dies before the flush leaves recorded assignments that
  are taken back after `ojs_ml_assignment_timeout_s`, as any lost delivery is.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_ojs_ml.allocator.model import Demand
from celery_ojs_ml.leader.budget_holds import BudgetHold
from celery_ojs_ml.leader.fleet_view import Ledger
from celery_ojs_ml.lru import LRU
from celery_ojs_ml.scheduler import Decision, PendingJob, Policy
from celery_ojs_ml.scheduler.pools import PREFIX
from celery_ojs_ml.spec.resources import gpu_share
from celery_ojs_ml.store import broker as redis_intake
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.reservations import ReservationBook
from celery_ojs_ml.wire.queues import ml_queue, worker_queue_name
from celery_ojs_ml.worker.gangs import HEADER_RENDEZVOUS

log = logging.getLogger("celery_ojs_ml.leader.loop")

HEADER_ASSIGN = "ojs_assign"
HEADER_VICTIMS = "ojs_victims"
HEADER_PREFETCH = "ojs_prefetch"


def task_events_wanted(live: dict[str, Any]) -> bool:
    """Whether some live worker sends task events (its advertisement's `task_events`)."""
    return any((e.get("info") or {}).get("task_events") for e in live.values())


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """One assignment's delivery, built before the assignment is recorded."""

    task_id: str
    worker: str
    token: str
    victims: tuple[str, ...]
    prefetch: bool
    queue: str
    body: bytes
    headers: dict[str, Any]
    content_type: str
    content_encoding: str
    properties: dict[str, Any]
    push: tuple[str, bytes] | None
    """(list key, raw message) for the assignment's Lua call; None: publish through kombu."""


class Delivery:
    """Assign, publish, annotate (see module doc)."""

    app: Any
    settings: Any
    book: PendingBook
    ledger: Ledger
    reservations: ReservationBook
    _producer: Any
    _direct: Any
    """The broker channel whose lists the leader pushes deliveries onto itself
    (`redis_intake.direct_channel`); None: publish through kombu."""
    _reliable: Any
    """The Redis intake (`intake.Intake`); None on other brokers."""
    _events: Any
    """The leader's event dispatcher (`_event`); None until the first event."""
    _task_events: bool
    """Whether a live worker sends task events (its advertisement's `task_events`)."""
    _declared: set[str]
    _prefetched: dict[str, str]
    policy: Policy
    _budgeted: set[str]
    _holds: dict[str, BudgetHold]
    _rendezvous: dict[str, dict[str, Any]]
    _escalated: LRU[str, bool]
    _notes: LRU[str, tuple[str, float | None]]

    def _batch(self) -> Any:
        """kombu's publish batch (kombu >= 5.7; one pipeline on Redis), else nothing.

        Each assignment is recorded in the store before the batch is flushed, so
        a leader that dies in between leaves assignments that are taken back
        after `ojs_ml_assignment_timeout_s`, as any lost delivery is.
        """
        batch = getattr(self._producer, "batch", None)
        return batch() if batch is not None else contextlib.nullcontext()

    def _deliver(
        self,
        task_id: str,
        worker: str,
        record: dict[str, Any],
        job: PendingJob,
        victims: tuple[str, ...],
        now: float,
        *,
        prefetch: bool = False,
    ) -> bool:
        """Assign and publish one job; False where it was not pending any more."""
        out = self._outgoing(task_id, worker, record, victims, prefetch)
        if not self.book.assign(
            task_id, worker, now=now, victims=victims, token=out.token, push=out.push
        ):
            return False
        self._sent(out, job, now)
        return True

    def _deliver_all(
        self,
        items: list[tuple[str, str, dict[str, Any], PendingJob]],
        now: float,
        notes: dict[str, tuple[str, float | None, str | None]],
        before: Callable[[Any], Callable[[Any], None] | None] | None = None,
    ) -> int:
        """A pass's plain assignments (`_deliver`) and its changed annotations: the
        assignment calls and the notes' writes in one pipeline (`before`: the fast
        lane's admission, ahead of them). Returns how many were assigned."""
        outs = [self._outgoing(t, w, record, (), False) for t, w, record, _ in items]
        items_out = [(o.task_id, o.worker, o.token, o.push) for o in outs]
        tokens = self.book.assign_many(items_out, now, notes, self._settle_in(), before)
        sent = 0
        for out, token, item in zip(outs, tokens, items, strict=True):
            if token is not None:
                self._sent(out, item[3], now)
                sent += 1
        return sent

    def _settle_in(self) -> Callable[[Any], None] | None:
        """With the store on the broker's Redis (`_direct`), the intake messages admitted
        so far are settled in the assignments' pipeline (`RedisIntake.done_in`)."""
        reliable = self._reliable
        return reliable.done_in if reliable is not None and self._direct is not None else None

    def _outgoing(
        self,
        task_id: str,
        worker: str,
        record: dict[str, Any],
        victims: tuple[str, ...],
        prefetch: bool,
    ) -> _Outgoing:
        """The assignment's delivered message, built before it is recorded."""
        token = uuid.uuid4().hex
        msg = record["msg"]
        headers = self._headers(task_id, msg["headers"], token, victims, prefetch)
        name = worker_queue_name(self.settings.store_prefix, worker)
        body = base64.b64decode(msg["body"])
        ctype = msg.get("content_type") or "application/json"
        cenc = msg.get("content_encoding") or "utf-8"
        props = _prioritized(msg.get("properties", {}), record.get("priority"))
        push = None  # with the store on the broker's Redis: pushed by the assignment's Lua call
        if self._direct is not None:
            push = redis_intake.envelope(self._direct, name, body, headers, props, ctype, cenc)
        return _Outgoing(
            task_id, worker, token, victims, prefetch, name, body, headers, ctype, cenc, props, push
        )

    def _sent(self, out: _Outgoing, job: PendingJob, now: float) -> None:
        """An assignment recorded: account for it, publish it unless its Lua call pushed it."""
        self._account(out.task_id, out.worker, job, now, out.prefetch)
        if out.push is None:
            assert self._producer is not None
            self._producer.publish(
                out.body,
                exchange="",  # the default exchange routes by queue name: no binding lookup
                routing_key=out.queue,
                headers=out.headers,
                content_type=out.content_type,
                content_encoding=out.content_encoding,
                declare=[] if out.queue in self._declared else [ml_queue(out.queue)],
                **out.properties,
            )
            self._declared.add(out.queue)
        what = f"preempting {', '.join(out.victims)}" if out.victims else "to start"
        if out.prefetch:
            what = "ahead of capacity: prefetch"
        log.info("ojs-ml: assigned %s to %s (%s)", out.task_id, out.worker, what)

    def _headers(
        self,
        task_id: str,
        original: dict[str, Any],
        token: str,
        victims: tuple[str, ...],
        prefetch: bool,
    ) -> dict[str, Any]:
        """The delivered message's headers: the job's own, plus the assignment's."""
        headers = {**original, HEADER_ASSIGN: token, HEADER_VICTIMS: list(victims)}
        if prefetch:
            headers[HEADER_PREFETCH] = True
        if task_id in self._rendezvous:
            headers[HEADER_RENDEZVOUS] = self._rendezvous[task_id]
        headers.pop("ojs_pending", None)
        return headers

    def _account(
        self, task_id: str, worker: str, job: PendingJob, now: float, prefetch: bool
    ) -> None:
        """What the leader keeps of an assignment: prefetch, ledger, budget hold."""
        if prefetch:
            self._prefetched[task_id] = worker
        share = job.req if gpu_share(job.req) is not None else None
        self.ledger.assigned(task_id, worker, Demand.of(job.req), now, job.labels, share)
        if job.queue in self._budgeted or self.policy.weights:
            gpus = int(job.req.ext_ml_gpu_count or 0)
            self._holds[task_id] = BudgetHold(job.queue, gpus, worker)

    def _escalations(self, decision: Decision, jobs: dict[str, PendingJob]) -> None:
        """Log and send `ojs-escalated` once for each job a pass first sees escalated (§8.4)."""
        fresh = [(t, was) for t, was in decision.escalations.items() if t not in self._escalated]
        if not fresh:
            return
        for task_id, was in fresh:
            self._escalated[task_id] = True
            to = jobs[task_id].req.ext_ml_escalation_target_class
            log.info("ojs-ml: %s escalated from %s to %s (OJS ML §8.4)", task_id, was, to)
            self._event("ojs-escalated", {"uuid": task_id, "band_from": was, "band_to": to})

    def _event(self, kind: str, fields: dict[str, Any]) -> None:
        """Send an `ojs-*` event through the leader's producer: inside a pass's publish
        batch it rides the batch's one round trip (kombu >= 5.7 on Redis). Only while
        some live worker sends task events (`-E`, or Flower's `enable_events`): as the
        workers' own events, none are built when nobody asked for them."""
        if not self._task_events:
            return
        if self._producer is None:
            with self.app.events.default_dispatcher() as dispatcher:
                dispatcher.send(kind, **fields)
            return
        if self._events is None:
            self._events = self.app.events.Dispatcher(
                channel=self._producer.channel, enabled=False, buffer_while_offline=False
            )
        self._events.publish(kind, fields, self._producer)

    def _changed_notes(self, decision: Decision) -> tuple[dict[str, Any], list[Any]]:
        """The pass's annotations that changed since last written, and those annotated
        for the first time (each gets an `ojs-resource-waiting` event)."""
        changed: dict[str, tuple[str, float | None, str | None]] = {}
        first_seen = []
        for task_id, note in decision.annotations.items():
            if task_id.startswith(PREFIX):
                self.reservations.note(task_id[len(PREFIX) :], note.reason_pending)
                continue
            key = (note.reason_pending, note.t_estimate)
            if self._notes.get(task_id) == key:
                continue
            first = task_id not in self._notes
            self._notes[task_id] = key
            changed[task_id] = (note.reason_pending, note.t_estimate, note.worker)
            if first:
                first_seen.append(note)
        return changed, first_seen

    def _waiting_events(self, first_seen: list[Any]) -> None:
        for note in first_seen:
            fields: dict[str, Any] = {"uuid": note.task_id, "reason": note.reason_pending}
            fields |= {"t_estimate": note.t_estimate, "worker": note.worker}
            self._event("ojs-resource-waiting", fields)


def _prioritized(properties: dict[str, Any], priority: Any) -> dict[str, Any]:
    """The message's properties with the priority the pending set holds for it (RFC 27
    prioritize may have changed it since it was published), so its gate orders it so."""
    try:
        wanted = int(priority)
    except (TypeError, ValueError):
        return properties
    if properties.get("priority") == wanted or (wanted == 0 and not properties.get("priority")):
        return properties
    return {**properties, "priority": wanted}
