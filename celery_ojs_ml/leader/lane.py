"""The leader's fast lane: arrivals decided on the fleet as the last quiet pass read it.

A mixin of `scheduling.FleetScheduler`, split out of it to keep modules small;
every attribute below is set by `FleetScheduler.__init__` or its other mixins.

Responsibility: take the pass's first reads (`pass_reads`, a round trip and
their parsing, a third of a pass) off the path of a job arriving at a quiet
fleet, where they cannot change the decision.

Key decisions:
* A pass whose reads find nothing waiting, nothing assigned, no reservation,
  and no assignment in flight that the workers' heartbeats do not show yet
  (the `Ledger` empty after the pass) read the fleet exactly: every free GPU
  is in an advertisement. Its `WorkerState`s are kept (`_quiet`) for
  `_LANE_AGE_S`, and for one use.
* Whatever changes free capacity without this leader's own assignment ends
  the lane first: a worker's wake-up (capacity freed, a job given back, a
  worker joined, an RFC 27 request or a reservation from the API all send
  one), any pass that decides jobs, a new leadership, a closed connection.
  A worker that left within the lane's second (a warm shutdown deletes its
  advertisement and sends no wake-up: with no leader left it would stay on
  the intake) may be assigned a job; the next pass finds it gone and takes
  the job back, as any assignment to a departed worker, so the job starts
  about a second late, never twice. A worker that dies without a word stays
  in the advertisements for their TTL in a full pass as well.
* The arrivals are decided by the same policy core, on that fleet. Only a
  decision that starts every one of them now is carried out, with their
  admission ahead of their assignments in one pipeline (the assignment's
  script finds the record the admission just wrote). Anything else (a job
  that must wait, a preemption, a denial, a gang rank, a reservation's job)
  falls back to a full pass, which reads everything again; nothing was
  written. Budgets and fair-share weights need the full pass's accounting,
  so the lane stays shut with them. Prefetch does not: a fleet with a job
  delivered ahead is not quiet (the job is in the ledger until it starts).
* The gate stays the safety net: an assignment that no longer fits is given
  back, as any stale assignment is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from celery_ojs_ml.leader.delivery import task_events_wanted
from celery_ojs_ml.leader.fleet_view import Ledger, pending_job
from celery_ojs_ml.scheduler import Decision, Memo, PendingJob, Policy, WorkerState, schedule
from celery_ojs_ml.store.pending import PENDING
from celery_ojs_ml.wire.settings import OJSMLSettings

_LANE_AGE_S = 1.0
"""Longest a quiet pass's fleet is used for an arrival (the leader passes every
`ojs_ml_scheduler_interval_s`, 0.5 s by default, when nothing happens)."""
_LANE_MAX = 16
"""Most arrivals decided in the lane at once; a larger batch takes a full pass."""


class Lane:
    """`_quiet` keeps a quiet pass's fleet, `_fast` decides arrivals on it (see module doc)."""

    settings: OJSMLSettings
    policy: Policy
    memo: Memo
    ledger: Ledger
    _lane: tuple[float, list[WorkerState]] | None
    _intake: list[tuple[str, dict[str, Any], dict[str, Any], Any]]
    _direct: Any
    _dirty: bool
    _task_events: bool
    lane_passes: int
    parse: Callable[[Any], Any]
    _fleet: Callable[..., list[WorkerState]]
    _admission: Callable[[Any], Callable[[Any], None] | None]
    _batch: Callable[[], Any]
    _changed_notes: Callable[[Decision], tuple[dict[str, Any], list[Any]]]
    _deliver_all: Callable[..., int]
    _waiting_events: Callable[[list[Any]], None]
    _granted: dict[str, tuple[str, str]]
    _lane_blocked: Callable[[Decision, dict[str, PendingJob]], bool]
    _tend_grants: Callable[[dict[str, Any], list[WorkerState] | None], None]
    _grant_after: Callable[..., None]

    def _lane_open(self) -> bool:
        """Whether this leader may use the lane at all (see module doc)."""
        return self._direct is not None and not self.policy.counts_assignments

    def _quiet(self, live: dict[str, Any], leases: list[Any]) -> None:
        """A pass found nothing waiting or assigned: keep its fleet for the next arrival."""
        self._task_events = task_events_wanted(live)
        lane = self._lane_open()
        fleet = self._fleet({}, live, leases, time.time()) if lane or self._granted else None
        self._tend_grants(live, fleet)
        if fleet is not None and lane and not self.ledger.entries:
            self._lane = (time.monotonic(), fleet)  # every assignment shows in a heartbeat

    def _fast(self) -> Decision | None:
        """Decide and deliver the arrivals just read on the kept fleet; None (nothing
        written) where a full pass must decide them."""
        lane, arrivals = self._lane, self._intake
        if lane is None or not arrivals:
            return None
        self._lane = None  # one use: the assignments below change the fleet
        at, fleet = lane
        if time.monotonic() - at > _LANE_AGE_S or len(arrivals) > _LANE_MAX:
            return None
        found = self._lane_jobs(arrivals)
        if found is None:
            return None
        jobs, msgs = found
        now = time.time()
        decision = schedule(list(jobs.values()), fleet, now, self.policy, memo=self.memo)
        if len(decision.assignments) != len(jobs) or (
            decision.preemptions or decision.denials or decision.escalations
        ):
            return None
        if self._lane_blocked(decision, jobs):
            return None
        plain = [
            (a.task_id, a.worker, {"state": PENDING, "msg": msgs[a.task_id]}, jobs[a.task_id])
            for a in decision.assignments
        ]
        self._dirty = False  # what woke the leader is decided here
        with self._batch():
            notes, first_seen = self._changed_notes(decision)
            sent = self._deliver_all(plain, now, notes, before=self._admission)
            self._waiting_events(first_seen)
        if sent != len(plain):
            self._dirty = True  # admitted but not assigned: the next step passes at once
        else:
            self._grant_after(decision, jobs, frozenset(), False, fleet)
        self.lane_passes += 1
        return decision

    def _lane_jobs(
        self, arrivals: list[Any]
    ) -> tuple[dict[str, PendingJob], dict[str, dict[str, Any]]] | None:
        """The arrivals as the core's jobs, with their messages; None where one needs a
        full pass (a gang rank, a reservation's job, one that does not parse)."""
        jobs: dict[str, PendingJob] = {}
        msgs: dict[str, dict[str, Any]] = {}
        for task_id, meta, msg, _ in arrivals:
            try:
                job = pending_job(task_id, {"state": PENDING, "meta": meta, "msg": msg}, self.parse)
            except Exception:  # the full pass logs and skips it
                return None
            if job is None or job.gang is not None or task_id in jobs:
                return None
            if job.req.ext_ml_reservation_id is not None:
                return None
            jobs[task_id], msgs[task_id] = job, msg
        return jobs, msgs
