"""The leader's fast lane: arrivals decided on the fleet as the last quiet pass read it.

Responsibility: take the pass's first reads (`pass_reads`, a round trip and
their parsing, a third of a pass) off the path of a job arriving at a quiet
fleet, where they cannot change the decision.

Key decision: only a fleet read exactly (nothing waiting or in flight) is
kept, for one use and one second, and only a decision that starts every
arrival now is carried out; anything else falls back to a full pass. The gate
stays the safety net: an assignment that no longer fits is given back.
"""

from __future__ import annotations

import time
from typing import Any

from celery_ojs_ml.scheduler import Memo, PendingJob, Policy, WorkerState, schedule
from celery_ojs_ml.store.pending import PENDING

from .delivery import Delivery
from .fleet_view import pending_job
from .granting import Granting
from .intake import Arrival, Intake
from .link import BrokerLink
from .notes import Events, Notes
from .parsing import Parser
from .pass_state import PassState

_LANE_AGE_S = 1.0
"""Longest a quiet pass's fleet is used for an arrival (the leader passes every
`ojs_ml_scheduler_interval_s`, 0.5 s by default, when nothing happens)."""
_LANE_MAX = 16
"""Most arrivals decided in the lane at once; a larger batch takes a full pass."""


class Lane:
    """`keep` a quiet pass's fleet; `fast` decides arrivals on it.

    * A pass whose reads find nothing waiting, nothing assigned, no reservation,
      and no assignment in flight that the heartbeats do not show yet (the ledger
      empty) read the fleet exactly: every free GPU is in an advertisement. Its
      fleet is kept for `_LANE_AGE_S`, and for one use.
    * Whatever changes free capacity without this leader's own assignment ends the
      lane first: a worker's wake-up (capacity freed, a job given back, a worker
      joined, an RFC 27 request), any pass that decides jobs, a new leadership, a
      closed connection. A worker that left within the lane's second (a warm
      shutdown sends no wake-up) may be assigned a job; the next pass finds it gone
      and takes the job back, as any assignment to a departed worker.
    * The arrivals are decided by the same policy core on that fleet. Only a
      decision that starts every one of them now is carried out, with their
      admission ahead of their assignments in one pipeline; anything else (a job
      that must wait, a preemption, a denial, a gang rank, a reservation's job)
      falls back to a full pass, and nothing was written. Budgets and fair-share
      weights need the full pass's accounting, so the lane stays shut with them.
    """

    def __init__(
        self,
        policy: Policy,
        memo: Memo,
        parser: Parser,
        link: BrokerLink,
        intake: Intake,
        delivery: Delivery,
        notes: Notes,
        events: Events,
        granting: Granting,
    ) -> None:
        self.policy = policy
        self.memo = memo
        self.parser = parser
        self.link = link
        self.intake = intake
        self.delivery = delivery
        self.notes = notes
        self.events = events
        self.granting = granting
        self.kept: tuple[float, list[WorkerState]] | None = None
        """A quiet pass's fleet, and when it was read, for the next arrival."""
        self.passes = 0
        """Arrivals' decisions taken in the lane, for tests and benchmarks."""

    def open(self) -> bool:
        """Whether this leader may use the lane at all (see the class doc)."""
        return self.link.direct is not None and not self.policy.counts_assignments

    def keep(self, fleet: list[WorkerState]) -> None:
        """A quiet pass's fleet (every assignment shows in a heartbeat)."""
        self.kept = (time.monotonic(), fleet)

    def forget(self) -> None:
        """Capacity changed, or the connection closed: the next arrival takes a full pass."""
        self.kept = None

    def fast(self) -> PassState | None:
        """Decide and deliver the arrivals just read on the kept fleet; None (nothing
        written) where a full pass must decide them."""
        kept, arrivals = self.kept, self.intake.arrivals
        if kept is None or not arrivals:
            return None
        self.kept = None  # one use: the assignments below change the fleet
        at, fleet = kept
        if time.monotonic() - at > _LANE_AGE_S or len(arrivals) > _LANE_MAX:
            return None
        found = self._jobs(arrivals)
        if found is None:
            return None
        jobs, msgs = found
        now = time.time()
        decision = schedule(list(jobs.values()), fleet, now, self.policy, memo=self.memo)
        if len(decision.assignments) != len(jobs) or (
            decision.preemptions or decision.denials or decision.escalations
        ):
            return None
        state = PassState(now, fleet=fleet, jobs=jobs, decision=decision)
        if self.granting.lane_blocked(state):
            return None
        self._carry_out(state, msgs)
        self.passes += 1
        return state

    def _carry_out(self, state: PassState, msgs: dict[str, dict[str, Any]]) -> None:
        """Admit the arrivals and assign them in one pipeline, then grant after them."""
        plain = [
            (a.task_id, a.worker, {"state": PENDING, "msg": msgs[a.task_id]}, state.jobs[a.task_id])
            for a in state.decision.assignments
        ]
        with self.link.batch():
            notes, first_seen = self.notes.changed(state.decision)
            sent = self.delivery.deliver_all(state, plain, notes, before=self.intake.admission)
            self.events.waiting(first_seen)
        if sent != len(plain):
            state.dirty = True  # admitted but not assigned: the next step passes at once
        else:
            self.granting.grant_after(state)

    def _jobs(
        self, arrivals: list[Arrival]
    ) -> tuple[dict[str, PendingJob], dict[str, dict[str, Any]]] | None:
        """The arrivals as the core's jobs, with their messages; None where one needs a
        full pass (a gang rank, a reservation's job, one that does not parse)."""
        jobs: dict[str, PendingJob] = {}
        msgs: dict[str, dict[str, Any]] = {}
        parse = self.parser.requirements
        for task_id, meta, msg, _ in arrivals:
            try:
                job = pending_job(task_id, {"state": PENDING, "meta": meta, "msg": msg}, parse)
            except Exception:  # the full pass logs and skips it
                return None
            if job is None or job.gang is not None or task_id in jobs:
                return None
            if job.req.ext_ml_reservation_id is not None:
                return None
            jobs[task_id], msgs[task_id] = job, msg
        return jobs, msgs
