"""Delivering a pass's assignments: recorded with a token, then sent to the worker's queue.

Key decisions:
* An assignment is recorded in the store with a fresh token before its
  message is published to `<prefix>.ml.w.<worker>`, the one ML queue that
  worker consumes, as the job's own Celery message plus the token.
* A pass's deliveries go out in one kombu publish batch (one pipeline on
  Redis); a leader that dies before the flush leaves recorded assignments that
  are taken back after `ojs_ml_assignment_timeout_s`, as any lost delivery is.
"""

from __future__ import annotations

import base64
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_ojs_ml.allocator.model import Demand
from celery_ojs_ml.scheduler import PendingJob
from celery_ojs_ml.spec.resources import gpu_share
from celery_ojs_ml.store import broker
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.queues import ml_queue, worker_queue_name

from .budget_holds import BudgetHolds
from .ledger import Ledger
from .link import BrokerLink
from .notes import Note
from .pass_state import PassState

log = logging.getLogger("celery_ojs_ml.leader.loop")

Item = tuple[str, str, dict[str, Any], PendingJob]
"""(task id, worker, pending record, job) of one plain assignment."""


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
    """Assign, record, publish (see module doc)."""

    def __init__(
        self,
        prefix: str,
        book: PendingBook,
        ledger: Ledger,
        holds: BudgetHolds,
        link: BrokerLink,
    ) -> None:
        self.prefix = prefix
        self.book = book
        self.ledger = ledger
        self.holds = holds
        self.link = link

    def deliver(
        self,
        state: PassState,
        task_id: str,
        worker: str,
        victims: tuple[str, ...] = (),
        *,
        prefetch: bool = False,
    ) -> bool:
        """Assign and publish one of the pass's jobs; False where it was not pending any more."""
        out = self._outgoing(task_id, worker, state.records[task_id], victims, prefetch, state)
        if not self.book.assign(
            task_id, worker, now=state.now, victims=victims, token=out.token, push=out.push
        ):
            return False
        self._sent(out, state.jobs[task_id], state.now)
        return True

    def deliver_all(
        self,
        state: PassState,
        items: list[Item],
        notes: dict[str, Note],
        before: Callable[[Any], Callable[[Any], None] | None] | None = None,
    ) -> int:
        """A pass's plain assignments (`deliver`) and its changed annotations: the
        assignment calls and the notes' writes in one pipeline (`before`: the fast
        lane's admission, ahead of them). Returns how many were assigned."""
        outs = [self._outgoing(t, w, record, (), False, state) for t, w, record, _ in items]
        items_out = [(o.task_id, o.worker, o.token, o.push) for o in outs]
        tokens = self.book.assign_many(items_out, state.now, notes, self.link.settle_in(), before)
        sent = 0
        for out, token, item in zip(outs, tokens, items, strict=True):
            if token is not None:
                self._sent(out, item[3], state.now)
                sent += 1
        return sent

    def _outgoing(
        self,
        task_id: str,
        worker: str,
        record: dict[str, Any],
        victims: tuple[str, ...],
        prefetch: bool,
        state: PassState,
    ) -> _Outgoing:
        """The assignment's delivered message, built before it is recorded."""
        token = uuid.uuid4().hex
        msg = record["msg"]
        rendezvous = state.rendezvous.get(task_id)
        headers = _headers(msg["headers"], token, victims, prefetch, rendezvous)
        submitted = (record.get("meta") or {}).get("submitted_at")
        if submitted:  # the gate's `ojs-started` event reports the wait from it
            headers[h.SUBMITTED] = submitted
        name = worker_queue_name(self.prefix, worker)
        body = base64.b64decode(msg["body"])
        ctype = msg.get("content_type") or "application/json"
        cenc = msg.get("content_encoding") or "utf-8"
        props = _prioritized(msg.get("properties", {}), record.get("priority"))
        push = None  # with the store on the broker's Redis: pushed by the assignment's Lua call
        if self.link.direct is not None:
            push = broker.envelope(self.link.direct, name, body, headers, props, ctype, cenc)
        return _Outgoing(
            task_id, worker, token, victims, prefetch, name, body, headers, ctype, cenc, props, push
        )

    def _sent(self, out: _Outgoing, job: PendingJob, now: float) -> None:
        """An assignment recorded: account for it, publish it unless its Lua call pushed it."""
        share = job.req if gpu_share(job.req) is not None else None
        self.ledger.assigned(out.task_id, out.worker, Demand.of(job.req), now, job.labels, share)
        self.holds.add(out.task_id, job, out.worker)
        if out.push is None:
            self._publish(out)
        what = f"preempting {', '.join(out.victims)}" if out.victims else "to start"
        if out.prefetch:
            what = "ahead of capacity: prefetch"
        log.info("ojs-ml: assigned %s to %s (%s)", out.task_id, out.worker, what)

    def _publish(self, out: _Outgoing) -> None:
        link = self.link
        assert link.producer is not None
        link.producer.publish(
            out.body,
            exchange="",  # the default exchange routes by queue name: no binding lookup
            routing_key=out.queue,
            headers=out.headers,
            content_type=out.content_type,
            content_encoding=out.content_encoding,
            declare=[] if out.queue in link.declared else [ml_queue(out.queue)],
            **out.properties,
        )
        link.declared.add(out.queue)


def _headers(
    original: dict[str, Any],
    token: str,
    victims: tuple[str, ...],
    prefetch: bool,
    rendezvous: dict[str, Any] | None,
) -> dict[str, Any]:
    """The delivered message's headers: the job's own, plus the assignment's; the publish
    reason (why no worker fit at publish) does not travel with an assignment."""
    headers = {**original, h.ASSIGN: token, h.VICTIMS: list(victims)}
    if prefetch:
        headers[h.PREFETCH] = True
    if rendezvous is not None:
        headers[h.RENDEZVOUS] = rendezvous
    headers.pop(h.PENDING, None)
    return headers


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
