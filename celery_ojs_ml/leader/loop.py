"""The live fleet scheduler (DESIGN decision 9): elected, fed by the intake queue.

Responsibility: one loop that, while it holds the scheduler lock, moves newly
published ML jobs from the intake into the durable pending set, runs the pure
policy core over the pending set and the fleet, and delivers each assignment
as the job's own Celery message to the chosen worker's queue.

Key decisions: the lock in the store has a TTL (`ojs_ml_leader_ttl_s`) renewed
by the leader, as celery-redbeat does for beat; a new leader keeps nothing from
before (RFC 27 `hello` is its first pass). Each concern is a collaborator
(intake, pass inputs, delivery, prefetch, lane, grants), and what one pass
reads and decides is a `PassState` handed to them.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from functools import partial
from typing import Any

from celery_ojs_ml.scheduler import Decision, Memo, PendingJob, Policy, schedule
from celery_ojs_ml.scheduler.pools import PREFIX as RESERVATION
from celery_ojs_ml.store.broker import send_wake
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.reservations import ReservationBook, pools_of
from celery_ojs_ml.wire.batch import advertises, batches_requests
from celery_ojs_ml.wire.inbound import InboundCheck
from celery_ojs_ml.wire.queues import intake_name

from .budget_holds import BudgetHolds
from .delivery import Delivery
from .departed import Departed
from .fair_usage import FairUsage
from .gangs import record_members, rendezvous
from .gc_pause import gc_paused
from .granting import Granting
from .intake import Intake
from .lane import Lane
from .ledger import Ledger
from .link import BrokerLink
from .notes import Events, Notes, task_events_wanted
from .parsing import Parser
from .pass_inputs import PassInputs
from .pass_state import PassState
from .prefetch import Prefetch

log = logging.getLogger(__name__)

__all__ = ["FleetScheduler", "send_wake"]

_MIN_PASS_GAP_S = 0.01
"""Longest enforced time between two scheduling passes; the gap actually used is twice
the last pass's duration, up to this (see `FleetScheduler.step`)."""
_ADMIT_BATCH = 200
"""Most intake messages admitted per transaction (prefetch is 256)."""


def _policy(s: Any) -> Policy:
    """The leader's policy, from the app's settings."""
    found = Policy.from_settings(s)
    return Policy(
        reservation_depth=s.reservation_depth,
        min_runtime_before_preemption_s=s.min_runtime_before_preemption_s,
        allow_on_demand_preemption=s.allow_on_demand_preemption,
        locality_weight=s.locality_weight,
        budgets=found.budgets,
        weights=found.weights,
        fair_share_half_life_s=found.fair_share_half_life_s,
        estimate_depth=found.estimate_depth,
        drain_defer_s=found.drain_defer_s,
    )


class FleetScheduler:
    """One candidate for the scheduler lock; `run()` loops until `stop()`."""

    def __init__(self, app: Any, candidate: str | None = None) -> None:
        self.app = app
        self.settings = s = app.ojs_ml.settings
        self.store = app.ojs_ml.store
        self.candidate = candidate or f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}"
        self.book = PendingBook(self.store)
        self.policy = _policy(s)
        self.memo = Memo()
        self.ledger = Ledger()
        self.reservations = ReservationBook(self.store)
        self.link = BrokerLink(app, intake_name(s.store_prefix))
        self.leading_since: float | None = None
        self.passes = 0
        self._stop = threading.Event()
        self._dirty = True
        """Something happened that no pass decided on yet: pass without waiting."""
        self._gap_s = _MIN_PASS_GAP_S
        self._last_pass = 0.0
        self.last_pass_s: float | None = None
        """How long the last pass took; the lock's renewals carry it (`ojs-ml metrics`)."""
        self._compose(s)

    def _compose(self, s: Any) -> None:
        """Make the collaborators, each with what it needs."""
        check = InboundCheck(s.parse_options().bounds, s.max_header_bytes)
        self.parser = parser = Parser(check, s.max_preemptions)
        self.intake = Intake(self.app, self.store, self.book, parser.check, self.link, self._heard)
        self.inputs = PassInputs(
            self.app, s, self.store, self.book, self.reservations, self.ledger, self.policy,
            parser, self.intake,
        )  # fmt: skip
        self.holds = BudgetHolds(self.policy)
        self.fair_usage = FairUsage(self.store, self.policy)
        self.notes = Notes(self.reservations)
        self.departed = Departed(s.deny_unsatisfiable, s.deny_after_s)
        self.events = Events(self.app, self.link)
        self.delivery = Delivery(s.store_prefix, self.book, self.ledger, self.holds, self.link)
        self.prefetch = Prefetch(
            s, self.policy, self.book, self.delivery.deliver, self.holds, self.notes,
            parser.requirements, self.inputs.job, partial(batches, self.app),
        )  # fmt: skip
        self.granting = Granting(self.app, s, self.store, self.policy, self.link)
        self.lane = Lane(
            self.policy, self.memo, parser, self.link, self.intake, self.delivery, self.notes,
            self.events, self.granting,
        )  # fmt: skip

    @property
    def lane_passes(self) -> int:
        """Arrivals' decisions taken in the fast lane (`lane`), for tests and benchmarks."""
        return self.lane.passes

    def _heard(self, wake: bool) -> None:
        """An intake message was read; a wake-up means capacity changed (the lane ends)."""
        self._dirty = True
        if wake:
            self.lane.forget()

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        """Whether this candidate holds the scheduler lock now."""
        return self.leading_since is not None

    def stop(self) -> None:
        """Stop the loop and give the lock up."""
        self._stop.set()

    def wait_stopped(self, timeout_s: float) -> bool:
        """True once `stop()` was called; waits up to `timeout_s`."""
        return self._stop.wait(timeout_s)

    def run(self) -> None:
        """Lead when elected, otherwise stand by; never raises."""
        renew_every = self.settings.leader_ttl_s / 3
        renewed = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now - renewed >= renew_every or self.leading_since is None:
                    renewed = now
                    if not self._campaign():
                        self._stop.wait(renew_every)
                        continue
                self.step(self.settings.scheduler_interval_s)
            except Exception as exc:
                log.warning("ojs-ml: scheduler %s: %s", self.candidate, exc, exc_info=True)
                self.close()
                self._stop.wait(min(1.0, renew_every))
        self._resign()

    def _campaign(self) -> bool:
        leading = self.book.lead(
            self.candidate, self.settings.leader_ttl_s, pass_s=self.last_pass_s
        )
        if leading and self.leading_since is None:
            self.leading_since = time.time()
            self._dirty = True
            self.lane.forget()
            self.inputs.hello()  # RFC 27 hello: the first pass reads and decides everything
            self.departed.hello()
            self.granting.hello()
            self.fair_usage.hello()  # continue the last leader's decayed usage
            log.warning(
                "ojs-ml: %s leads the fleet scheduler (hello: %d jobs waiting or assigned)",
                self.candidate,
                len(self.book.records()),
            )
        elif not leading and self.leading_since is not None:
            log.warning("ojs-ml: %s lost the scheduler lock", self.candidate)
            self.leading_since = None
            self.close()
        return leading

    def _resign(self) -> None:
        self.close()
        if self.leading_since is not None:
            try:
                self.book.resign(self.candidate)
            except Exception as exc:
                log.debug("ojs-ml: could not resign the scheduler lock: %s", exc)
            self.leading_since = None

    def close(self) -> None:
        """Drop the connection; the jobs read and not admitted are redelivered."""
        self.intake.close()
        self.lane.forget()

    # -- the loop ---------------------------------------------------------------------------

    def step(self, wait_s: float) -> None:
        """Read the intake (waiting up to `wait_s` for news), then schedule once.

        A pass that started or preempted nothing is followed by a gap of twice its
        cost (at most `_MIN_PASS_GAP_S`): under a stream of arrivals into a full
        fleet one pass then decides everything that came in meanwhile, instead of
        one pass per job. A worker's wake-up ends the gap (`Intake.sit_out`). A pass
        that started jobs is followed by no gap: the capacity freed since is the
        next jobs' to take (with a gap after each pass as well, a backlog draining
        onto a worker left it idle a third of the time, `bench/dispatch.py`).
        """
        self.intake.connect()
        gap = self._last_pass + self._gap_s - time.monotonic()
        if gap > 0:
            self.intake.sit_out(gap, _ADMIT_BATCH)
        self.intake.read(0 if self._dirty else wait_s, _ADMIT_BATCH)
        began = time.monotonic()  # the pass admits what was read, with its first reads
        lane = self.lane.fast()
        if lane is not None:
            self._dirty = lane.dirty
            decision = lane.decision
        else:
            decision = self.schedule_once()
        self._last_pass = time.monotonic()
        self.last_pass_s = round(self._last_pass - began, 6)
        self.link.settle()  # after the pass: the admitted jobs are in the store already
        started = decision.assignments or decision.preemptions
        self._gap_s = 0.0 if started else min(_MIN_PASS_GAP_S, 2 * (self._last_pass - began))

    def schedule_once(self) -> Decision:
        """Take back stale assignments, run the policy core, assign, annotate."""
        self._dirty = False
        self.lane.forget()  # kept again only where these reads find the fleet quiet
        state = PassState(time.time())
        with gc_paused():
            return self._pass(state)

    def _pass(self, state: PassState) -> Decision:
        """`schedule_once` with the cyclic collector paused (`leader/gc_pause.py`)."""
        try:
            if not self.inputs.first_reads(state):
                if state.quiet:
                    self._quiet(state)
                return Decision()  # nothing waits or is assigned (a worker's wake-up when idle)
            self._decide(state)
            self._carry_out(state)
            self.granting.grant_after(state)
            self.granting.tend(state, state.fleet)
        finally:
            self._dirty = self._dirty or state.dirty
        self.passes += 1
        return state.decision

    def _decide(self, state: PassState) -> None:
        """Read the pass's inputs into `state` and run the policy core over them."""
        inputs = self.inputs
        self.events.wanted = task_events_wanted(state.live)
        inputs.take_back(state)
        state.fleet = inputs.fleet(state.records, state.live, state.leases, state.now)
        away = self.departed.observe(state.live, state.now)  # they count for DENY only
        policy = self.departed.policy(inputs.pass_policy(), state.now)
        waiting = inputs.waiting(state)
        if self.policy.counts_assignments:
            state.inflight = self.holds.inflight(
                state.records, state.leases, state.live, self.book, self.prefetch.sent
            )
        state.usage = self.fair_usage.advance(state)
        tended = self.reservations.tend(state.now) if state.reserving else {}
        held = pools_of(tended, state.live, self.parser.check.parse, state.now)
        began = time.monotonic()
        state.decision = schedule(
            waiting, [*state.fleet, *away], state.now, policy, memo=self.memo,
            inflight=state.inflight, pools=held, usage=state.usage,
        )  # fmt: skip
        inputs.decided(time.monotonic() - began)
        state.jobs = {j.task_id: j for j in waiting}

    def _carry_out(self, state: PassState) -> None:
        """Deliver the pass's assignments and preemptions, deny, place, prefetch, annotate."""
        decision = state.decision
        if decision.budgets:
            key = self.store.key("scheduler", "budgets")
            self.store.client.set(key, json.dumps(decision.budgets), px=60_000)
        state.rendezvous = rendezvous(decision, state.jobs, state.live)
        if state.rendezvous:
            record_members(self.store, state.rendezvous)
        self.events.escalations(decision, state.jobs)
        state.blocked = self.granting.contested(state)
        self.granting.revoke_contested(state)
        with self.link.batch():  # every kombu publish of the pass in one broker round trip
            plain = []
            for a in decision.assignments:
                if a.task_id.startswith(RESERVATION):
                    self._place(state, a.task_id[len(RESERVATION) :], a.worker)
                    continue
                plain.append((a.task_id, a.worker, state.records[a.task_id], state.jobs[a.task_id]))
            notes, first_seen = self.notes.changed(decision)
            self.delivery.deliver_all(state, plain, notes)  # the notes' writes ride its pipeline
            for d in decision.denials:
                self._deny(d.task_id, state.records.get(d.task_id), self.departed.note(d))
            for p in decision.preemptions:
                self.delivery.deliver(state, p.task_id, p.worker, p.victims)
            # A job waiting ahead at a gate holds no GPU: it counts in its queue's fair
            # share from its start; a budgeted queue's jobs stay here (`Prefetch`).
            if self.settings.prefetch:
                self.prefetch.unhold(state)
                self.prefetch.send_ahead(state)
            self.events.waiting(first_seen)  # they ride the same batch

    def _quiet(self, state: PassState) -> None:
        """A pass found nothing waiting or assigned: keep its fleet for the next arrival."""
        self.events.wanted = task_events_wanted(state.live)
        self.departed.observe(state.live, state.now)
        lane = self.lane.open()
        fleet = None
        if lane or self.granting.granted:
            fleet = self.inputs.fleet({}, state.live, state.leases, time.time())
        self.granting.tend(state, fleet)
        if fleet is not None and lane and not self.ledger.entries:
            self.lane.keep(fleet)  # every assignment shows in a heartbeat

    def _place(self, state: PassState, rid: str, worker: str) -> None:
        """A reservation's placement: recorded (not published); the worker's gate holds it."""
        if self.reservations.place(rid, worker):
            log.info("ojs-ml: placed reservation %s on %s", rid, worker)
            state.dirty = True

    def _deny(self, task_id: str, record: dict[str, Any] | None, note: str) -> None:
        """RFC 27 DENY of a waiting job: drop it from the set, fail it, dead-letter it."""
        if record is None or not self.book.cancel(task_id):
            return
        msg = record.get("msg") or {}
        body = base64.b64decode(msg.get("body") or b"")
        self.intake.refuse(task_id, dict(msg.get("headers") or {}), body, note)


def batches(app: Any, job: PendingJob, live: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether the job's task batches its requests (`wire.batch.batches_requests`): in this
    process's task registry, or as a live worker's heartbeat lists it (`info.batching`),
    for a task the leader's process never imported."""
    name = job.labels.get("job_type")
    if not isinstance(name, str) or not name:
        return False
    task = app.tasks.get(name)
    if task is not None and batches_requests(task):
        return True
    return any(advertises(_info(entry), name) for entry in live.values())


def _info(entry: Any) -> Any:
    """A heartbeat's `info`; None for an entry of another shape."""
    return entry.get("info") if isinstance(entry, Mapping) else None
