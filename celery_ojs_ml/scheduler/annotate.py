"""`reason_pending` for waiting jobs, in the words of matching's one formatter.

Key decision: the reason is built once the pass is over, from the fleet as the
pass leaves it, so it explains the state the job will actually wait in. Every
worker contributes one `MatchResult` (shared by all workers of a group in the
same shape) to `matching.pending_message`; the scheduler only adds results for
what matching cannot see: a queue the worker does not consume, a worker that is
away, capacity reserved for a job ahead (`reserved for <task id>`), and a
dedicated job facing a busy worker. Messages are cached per class and per
outcome on the reserved workers, so 10,000 waiting jobs format a handful.
"""

from __future__ import annotations

from collections.abc import Hashable

from celery_ojs_ml.matching import MatchResult, Reason, Verdict, pending_message
from celery_ojs_ml.scheduler.candidates import Group
from celery_ojs_ml.scheduler.fleet import FleetView
from celery_ojs_ml.scheduler.order import Ask
from celery_ojs_ml.scheduler.slot import Slot


def queue_reason(queue: str) -> Reason:
    """The worker does not consume the job's logical queue."""
    return Reason("queue", queue, None, None, Verdict.NEVER, "queue {r} not consumed")


def away_reason() -> Reason:
    """The worker has missed its heartbeat; it may come back."""
    return Reason("worker", "available", "away", None, Verdict.WAIT, "worker away")


def reserved_reason(holder: str) -> Reason:
    """The free capacity is reserved for a job ahead and this job cannot backfill it."""
    text = "reserved for " + holder.replace("{", "{{").replace("}", "}}")
    return Reason("reservation", None, holder, None, Verdict.WAIT, text)


def dedicated_reason() -> Reason:
    """A dedicated job needs a worker with nothing running, and keeps it to itself."""
    return Reason("gpu_affinity", "dedicated", "busy", None, Verdict.WAIT, "worker busy, dedicated")


class Annotator:
    """Builds and caches pending messages for one pass (see module doc)."""

    def __init__(self, view: FleetView) -> None:
        self.view = view
        self._messages: dict[Hashable, str] = {}
        self._outcomes: dict[Hashable, tuple[bool, bool, str | None]] = {}
        self._alike: dict[Hashable, str] = {}
        self._holders: set[str] | None = None

    def reason(self, ask: Ask) -> str:
        """The pending message of a waiting job: the same for every job with the same class,
        queue, affinity, footprint and end, unless it holds a reservation."""
        job = ask.job
        if self._holders is None:
            slots = self.view.slots
            self._holders = {
                h for g in self.view.groups for i in g.reserved if (h := slots[i].first_holder())
            }
        if job.task_id in self._holders:
            return self._reason(ask)
        key = (job.class_key, job.queue, job.gpu_affinity, ask.want, ask.end)
        hit = self._alike.get(key)
        if hit is None:
            hit = self._alike[key] = self._reason(ask)
        return hit

    def _reason(self, ask: Ask) -> str:
        job = ask.job
        outcomes = tuple(self._reserved_outcomes(ask))
        key = (job.class_key, job.queue, job.gpu_affinity, outcomes)
        hit = self._messages.get(key)
        if hit is None:
            hit = self._messages[key] = pending_message(self._results(ask))
        return hit

    def _reserved_outcomes(self, ask: Ask) -> list[tuple[int, bool, bool]]:
        """(worker, may backfill, holds it) for each reserved worker the job could fit now."""
        out = []
        job = ask.job
        for group in self.view.eligible(job):
            for i in group.reserved:
                key = (job.class_key, ask.want, ask.dedicated, ask.end, i)
                found = self._outcomes.get(key)
                if found is None:
                    found = self._outcomes[key] = self._outcome(ask, group, self.view.slots[i])
                if found[0]:
                    out.append((i, found[1], found[2] == job.task_id))
        return out

    def _outcome(self, ask: Ask, group: Group, slot: Slot) -> tuple[bool, bool, str | None]:
        """Whether alike jobs fit `slot` now and may backfill it, and its first holder
        (the same for every job with the same needs and end: the pass is over)."""
        if not self._fits(ask, group, slot):
            return False, False, None
        return True, self.view.may_backfill(ask, slot), slot.first_holder()

    def _fits(self, ask: Ask, group: Group, slot: Slot) -> bool:
        found = self.view.verdict(ask.job, group, slot.shape())
        return found.verdict is Verdict.FITS and not (ask.dedicated and not slot.idle)

    def _results(self, ask: Ask) -> list[MatchResult]:
        out: list[MatchResult] = []
        for group in self.view.groups:
            if ask.job.queue not in group.queues:
                ever = self.view.memo.ever(ask.job, group.caps_key, group.caps)
                found = MatchResult(Verdict.NEVER, (queue_reason(ask.job.queue), *ever.reasons))
                out += [found] * (len(group.members) + len(group.away))
                continue
            for members in group.buckets.values():
                first = self.view.slots[next(iter(members))]
                out += [self._at(ask, group, first)] * len(members)
            slots = [self.view.slots[i] for i in group.members]
            out += [self._at(ask, group, x) for x in slots if x.closed or x.idx in group.reserved]
            out += [self._away(ask, group, self.view.slots[i]) for i in group.away]
        return out

    def _at(self, ask: Ask, group: Group, slot: Slot) -> MatchResult:
        found = self.view.verdict(ask.job, group, slot.shape())
        if found.verdict is not Verdict.FITS:
            return found
        if slot.closed or (ask.dedicated and not slot.idle):
            return MatchResult(Verdict.WAIT, (dedicated_reason(),))
        holder = slot.first_holder()
        if holder is None or holder == ask.job.task_id or self.view.may_backfill(ask, slot):
            return found
        return MatchResult(Verdict.WAIT, (reserved_reason(holder),))

    def _away(self, ask: Ask, group: Group, slot: Slot) -> MatchResult:
        found = self.view.verdict(ask.job, group, slot.shape())
        if found.verdict is Verdict.NEVER:
            return found
        return MatchResult(Verdict.WAIT, (*found.reasons, away_reason()))
