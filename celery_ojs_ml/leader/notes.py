"""What the leader tells users: waiting jobs' annotations and `ojs-*` events.

Key decisions:
* An annotation (RFC 27 `annotate`: `reason_pending`, `t_estimate`) is written
  only when it changed since this leader last wrote it, in the pass's
  assignment pipeline; a job annotated for the first time gets one
  `ojs-resource-waiting` event.
* Events go out only while some live worker sends task events (`-E`, or
  Flower's `enable_events`), through the leader's producer, so inside a pass's
  publish batch they ride its one round trip.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_ojs_ml.lru import LRU
from celery_ojs_ml.scheduler import Annotation, Decision, PendingJob
from celery_ojs_ml.scheduler.pools import PREFIX as RESERVATION
from celery_ojs_ml.store.reservations import ReservationBook

from .link import BrokerLink

log = logging.getLogger("celery_ojs_ml.leader.loop")

Note = tuple[str, float | None, str | None]
"""(reason_pending, t_estimate, worker) as the pending record keeps it."""


def task_events_wanted(live: dict[str, Any]) -> bool:
    """Whether some live worker sends task events (its advertisement's `task_events`)."""
    return any((e.get("info") or {}).get("task_events") for e in live.values())


class Notes:
    """The annotations this leader last wrote, to write only what changed."""

    def __init__(self, reservations: ReservationBook) -> None:
        self.reservations = reservations
        self.written: LRU[str, tuple[str, float | None]] = LRU(100_000)

    def changed(self, decision: Decision) -> tuple[dict[str, Note], list[Annotation]]:
        """The pass's annotations that changed since last written, and those annotated
        for the first time (each gets an `ojs-resource-waiting` event)."""
        changed: dict[str, Note] = {}
        first_seen = []
        for task_id, note in decision.annotations.items():
            if task_id.startswith(RESERVATION):
                self.reservations.note(task_id[len(RESERVATION) :], note.reason_pending)
                continue
            key = (note.reason_pending, note.t_estimate)
            if self.written.get(task_id) == key:
                continue
            first = task_id not in self.written
            self.written[task_id] = key
            changed[task_id] = (note.reason_pending, note.t_estimate, note.worker)
            if first:
                first_seen.append(note)
        return changed, first_seen

    def delivered_ahead(self, task_ids: list[str]) -> None:
        """Jobs written with their prefetch note: annotated afresh if taken back."""
        for task_id in task_ids:
            self.written[task_id] = ("delivered ahead", None)


class Events:
    """`ojs-escalated` and `ojs-resource-waiting`, sent while some worker sends events."""

    def __init__(self, app: Any, link: BrokerLink) -> None:
        self.app = app
        self.link = link
        self.wanted = False
        """Whether a live worker sends task events, as the last pass read them."""
        self.escalated: LRU[str, bool] = LRU(100_000)
        """Jobs whose escalation was told already."""

    def send(self, kind: str, fields: dict[str, Any]) -> None:
        """Send an `ojs-*` event through the leader's producer (see module doc)."""
        if not self.wanted:
            return
        link = self.link
        if link.producer is None:
            with self.app.events.default_dispatcher() as dispatcher:
                dispatcher.send(kind, **fields)
            return
        if link.events is None:
            link.events = self.app.events.Dispatcher(
                channel=link.producer.channel, enabled=False, buffer_while_offline=False
            )
        link.events.publish(kind, fields, link.producer)

    def escalations(self, decision: Decision, jobs: dict[str, PendingJob]) -> None:
        """Log and send `ojs-escalated` once for each job a pass first sees escalated (§8.4)."""
        fresh = [(t, was) for t, was in decision.escalations.items() if t not in self.escalated]
        for task_id, was in fresh:
            self.escalated[task_id] = True
            to = jobs[task_id].req.ext_ml_escalation_target_class
            log.info("ojs-ml: %s escalated from %s to %s (OJS ML §8.4)", task_id, was, to)
            self.send("ojs-escalated", {"uuid": task_id, "band_from": was, "band_to": to})

    def waiting(self, first_seen: list[Annotation]) -> None:
        """`ojs-resource-waiting` for each job annotated for the first time."""
        for note in first_seen:
            fields: dict[str, Any] = {"uuid": note.task_id, "reason": note.reason_pending}
            fields |= {"t_estimate": note.t_estimate, "worker": note.worker}
            self.send("ojs-resource-waiting", fields)
