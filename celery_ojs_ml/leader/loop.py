"""The live fleet scheduler (DESIGN decision 9): elected, fed by the intake queue.

Responsibility: one loop that, while it holds the scheduler lock, moves newly
published ML jobs from the intake queue into the durable pending set, runs the
pure policy core over the pending set and the fleet, and delivers each
assignment as the job's own Celery message to the chosen worker's queue.

Key decisions:
- Every plugin worker runs a candidate in a thread (`ojs_ml_scheduler =
  "auto"`); `celery ojs-ml scheduler` runs one standalone. The lock in the
  store has a TTL (`ojs_ml_leader_ttl_s`) renewed by the leader, as
  celery-redbeat does for beat.
- A new leader keeps nothing from before: every pass reads the pending set,
  the live workers and the leases (RFC 27 `hello` is the first pass).
- The intake queue is an ordinary broker queue, so a job published while no
  leader runs waits there durably; its message is acked only once it is in
  the store. Workers put a tiny wake-up message on the same queue when they
  free capacity, so the loop has one place to block and wakes at once.
- An assignment is recorded with a fresh token before its message is
  published; the gate starts the job only while that token is current, and
  an assignment not started within `ojs_ml_assignment_timeout_s` is taken
  back (fenced by the token) and reassigned.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
import time
import uuid
from typing import Any

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.leader.budget_holds import BudgetHold
from celery_ojs_ml.leader.delivery import Delivery, task_events_wanted
from celery_ojs_ml.leader.fleet_view import (
    Ledger,
    allocated_ids,
    worker_states,
)
from celery_ojs_ml.leader.granting import Granting
from celery_ojs_ml.leader.intake import HEADER_WAKE, Intake
from celery_ojs_ml.leader.lane import Lane
from celery_ojs_ml.leader.pass_inputs import PassInputs
from celery_ojs_ml.leader.pending_view import PendingView
from celery_ojs_ml.leader.prefetch import Prefetching
from celery_ojs_ml.lru import LRU
from celery_ojs_ml.scheduler import Decision, Memo, PendingJob, Policy, WorkerState, schedule
from celery_ojs_ml.scheduler.pools import PREFIX
from celery_ojs_ml.scheduler.window import Window
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.reservations import ReservationBook, pools_of
from celery_ojs_ml.wire.inbound import Admission
from celery_ojs_ml.wire.queues import intake_name, ml_queue
from celery_ojs_ml.worker.gangs import record_members, rendezvous

log = logging.getLogger(__name__)

_MIN_PASS_GAP_S = 0.01
"""Longest enforced time between two scheduling passes; the gap actually used is twice
the last pass's duration, up to this (see `FleetScheduler.step`)."""
_ADMIT_BATCH = 200
"""Most intake messages admitted per transaction (prefetch is 256)."""


def send_wake(app: Any, worker: str) -> None:
    """Tell the scheduler that `worker` freed capacity (a message on the intake queue)."""
    name = intake_name(app.ojs_ml.settings.store_prefix)
    with app.producer_or_acquire() as producer:
        producer.publish(
            {"worker": worker},
            exchange=name,
            routing_key=name,
            headers={HEADER_WAKE: worker},
            declare=[ml_queue(name)],
            serializer="json",
            retry=False,
        )


class FleetScheduler(Intake, Prefetching, Delivery, PassInputs, Lane, Granting):
    """One candidate for the scheduler lock; `run()` loops until `stop()`."""

    def __init__(self, app: Any, candidate: str | None = None) -> None:
        self.app = app
        plugin = app.ojs_ml
        s = self.settings = plugin.settings
        self.store = plugin.store
        self.book = PendingBook(self.store)
        self.view = PendingView(self.book)
        self.book.on_admit = self.view.put
        self.leases = LeaseBook(self.store, s.lease_ttl_s)
        self.candidate = candidate or f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}"
        self.admission = Admission(s.parse_options().bounds, s.max_header_bytes)
        self.policy = Policy(
            reservation_depth=s.reservation_depth,
            min_runtime_before_preemption_s=s.min_runtime_before_preemption_s,
            allow_on_demand_preemption=s.allow_on_demand_preemption,
            locality_weight=s.locality_weight,
            budgets=Policy.from_settings(s).budgets,
            weights=Policy.from_settings(s).weights,
        )
        self._budgeted = {queue for queue, _ in self.policy.budgets}
        self._holds: dict[str, BudgetHold] = {}
        """Assignments not yet seen running, of budgeted queues or, with fair-share
        weights, of every queue (see `budget_inflight`)."""
        self._escalated: LRU[str, bool] = LRU(100_000)
        """Queue of each job this leader assigned, for budgets until its lease shows it."""
        self.intake = intake_name(s.store_prefix)
        self.reservations = ReservationBook(self.store)
        self.ledger = Ledger()
        self._starts: dict[str, float | None] = {}
        self.memo = Memo()
        self.caps: LRU[str, Capabilities] = LRU(4096)
        self.leading_since: float | None = None
        self._stop = threading.Event()
        self._dirty = True
        self._woken = False
        self._full_pass_at = -1e9
        self._full_cost_s = 0.0
        self._deciding_all = True
        self._window: Window | None = None
        """The first jobs in order at the last complete ordering (`scheduler.window`)."""
        self._fresh: set[str] | None = set()
        """Jobs whose record changed since the window was made; None: no change marks."""
        self._declared: set[str] = set()
        self._notes: LRU[str, tuple[str, float | None]] = LRU(100_000)
        self._conn: Any = None
        self._consumer: Any = None
        self._reliable = None
        self._producer: Any = None
        self._direct: Any = None
        self._events: Any = None
        self._task_events = False
        self._last_pass = 0.0
        self._intake: list[tuple[str, dict[str, Any], dict[str, Any], Any]] = []
        """Admissions read from the intake, written in one batch after the drain."""
        self._admitted_late = False
        """The last admission ran after the pass's reads (`PassInputs._first_reads`)."""
        self.passes = 0
        self.lane_passes = 0
        """Arrivals' decisions taken in the fast lane (`lane`), for tests and benchmarks."""
        self._rendezvous: dict[str, dict[str, Any]] = {}
        self._gap_s = _MIN_PASS_GAP_S
        self._prefetched: dict[str, str] = {}
        self._pass_inflight: list[tuple[str, int]] = []
        self._ahead_notes: dict[str, tuple[str, float | None, str | None]] = {}
        self._turnover: dict[str, tuple[frozenset[str], float]] = {}
        self._lane: tuple[float, list[WorkerState]] | None = None
        """A quiet pass's fleet, for the next arrival (`lane`)."""
        self._granted: dict[str, tuple[str, str]] = {}
        self._grant_jobs: dict[str, PendingJob] = {}
        self._gone: dict[str, float] = {}
        self._grants_on: bool | None = None
        self._jobs: LRU[tuple[str, str, str], PendingJob | None] = LRU(20_000)
        """Parsed waiting jobs by (task id, admitted at, priority) (`_pending_job`)."""
        """Jobs delivered ahead of capacity (`_prefetch`) -> their worker, until started."""

    # -- lifecycle ------------------------------------------------------------------------

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
                self._close()
                self._stop.wait(min(1.0, renew_every))
        self._resign()

    def _campaign(self) -> bool:
        leading = self.book.lead(self.candidate, self.settings.leader_ttl_s)
        if leading and self.leading_since is None:
            self.leading_since = time.time()
            self._dirty = True
            self._lane = None
            self._full_pass_at = -1e9  # and decides every job in it
            self.view.reset()  # RFC 27 hello: the first pass reads the whole pending set
            self._hello_grants()
            log.warning(
                "ojs-ml: %s leads the fleet scheduler (hello: %d jobs waiting or assigned)",
                self.candidate,
                len(self.book.records()),
            )
        elif not leading and self.leading_since is not None:
            log.warning("ojs-ml: %s lost the scheduler lock", self.candidate)
            self.leading_since = None
            self._close()
        return leading

    def _resign(self) -> None:
        self._close()
        if self.leading_since is not None:
            try:
                self.book.resign(self.candidate)
            except Exception as exc:
                log.debug("ojs-ml: could not resign the scheduler lock: %s", exc)
            self.leading_since = None

    # -- the loop ---------------------------------------------------------------------------

    def step(self, wait_s: float) -> None:
        """Read the intake (waiting up to `wait_s` for news), then schedule once.

        A pass that started or preempted nothing is followed by a gap of twice its
        cost (at most `_MIN_PASS_GAP_S`): under a stream of arrivals into a full
        fleet one pass then decides everything that came in meanwhile, instead of
        one pass per job. A worker's wake-up ends the gap (`_sit_out`): the capacity
        it freed is not left idle for the rest of it. A pass that started jobs is
        followed by no gap: the capacity freed since is the next jobs' to take, and
        the leader's time stays in proportion to the jobs it starts (with the gap
        after each pass as well, a backlog draining onto a worker left it idle a
        third of the time, `bench/dispatch.py`).
        """
        self._connect()
        assert self._conn is not None
        gap = self._last_pass + self._gap_s - time.monotonic()
        if gap > 0:
            self._sit_out(gap, _ADMIT_BATCH)
        self._read(0 if self._dirty else wait_s, _ADMIT_BATCH)
        began = time.monotonic()  # the pass admits what was read, with its first reads
        decision = self._fast() or self.schedule_once()
        self._last_pass = time.monotonic()
        self._settle()  # after the pass: the admitted jobs are in the store already
        started = decision.assignments or decision.preemptions
        self._gap_s = 0.0 if started else min(_MIN_PASS_GAP_S, 2 * (self._last_pass - began))

    def schedule_once(self) -> Decision:
        """Take back stale assignments, run the policy core, assign, annotate."""
        self._dirty = False
        self._lane = None  # kept again only where these reads find the fleet quiet
        now = time.time()
        first = self._first_reads()
        if first is None:
            return Decision()  # nothing waits or is assigned (a worker's wake-up when idle)
        records, reserving, live, leases = first
        self._task_events = task_events_wanted(live)
        self._take_back(records, live, now)
        fleet = self._fleet(records, live, leases, now)
        policy = self._pass_policy()
        waiting = self._waiting(records, now)
        counted = self.policy.counts_assignments
        inflight = self._inflight(records, leases, live) if counted else []
        self._pass_inflight = inflight
        reserved = self.reservations.tend(now) if reserving else {}
        pools = pools_of(reserved, live, self.admission.parse, now)
        began = time.monotonic()
        decision = schedule(
            waiting, fleet, now, policy, memo=self.memo, inflight=inflight, pools=pools
        )
        if self._deciding_all:
            self._full_cost_s = time.monotonic() - began
        if decision.budgets:
            key = self.store.key("scheduler", "budgets")
            self.store.client.set(key, json.dumps(decision.budgets), px=60_000)
        jobs = {j.task_id: j for j in waiting}
        self._rendezvous = rendezvous(decision, jobs, live)
        if self._rendezvous:
            record_members(self.store, self._rendezvous)
        self._escalations(decision, jobs)
        blocked = self._contested(decision, jobs, fleet, records)
        self._revoke_contested(blocked, reserving, decision, jobs)
        self._carry_out(decision, fleet, records, jobs, now)
        self._grant_after(decision, jobs, blocked, reserving, fleet)
        self._tend_grants(live, fleet)
        self.passes += 1
        return decision

    def _fleet(
        self, records: dict[str, Any], live: dict[str, Any], leases: list[Any], now: float
    ) -> list[WorkerState]:
        """The core's view of the live workers: reports, leases, assignments in flight."""
        beats = {name: float(e.get("ts") or 0.0) for name, e in live.items()}
        shown = allocated_ids(live)
        used = self.ledger.used(records, beats, shown, now, self._started_at)
        return worker_states(
            live,
            leases,
            used,
            self.parse_running,
            self.caps,
            self._checkpoints(leases),
            self.ledger.labels(),
            self.ledger.shares(),
            self.ledger.jobs(),
            shown,
        )

    def _carry_out(
        self,
        decision: Decision,
        fleet: list[WorkerState],
        records: dict[str, Any],
        jobs: dict[str, PendingJob],
        now: float,
    ) -> None:
        """Deliver the pass's assignments and preemptions, deny, place, prefetch, annotate."""
        with self._batch():  # every kombu publish of the pass in one broker round trip
            plain = []
            for a in decision.assignments:
                if a.task_id.startswith(PREFIX):
                    self._place(a.task_id[len(PREFIX) :], a.worker)
                    continue
                plain.append((a.task_id, a.worker, records[a.task_id], jobs[a.task_id]))
            notes, first_seen = self._changed_notes(decision)
            self._deliver_all(plain, now, notes)  # the notes' writes ride its pipeline
            for d in decision.denials:
                self._deny(d.task_id, records.get(d.task_id), d.note)
            for p in decision.preemptions:
                job = jobs[p.task_id]
                self._deliver(p.task_id, p.worker, records[p.task_id], job, p.victims, now)
            # A job waiting ahead at a gate holds no GPU: it counts in its queue's fair
            # share from its start (`_inflight`); a budgeted queue's jobs stay here
            # (`_may_send_ahead`).
            if self.settings.prefetch:
                self._unhold(decision, fleet, records, jobs)
                self._prefetch(decision, fleet, records, jobs, now)
            self._waiting_events(first_seen)  # they ride the same batch

    def _place(self, rid: str, worker: str) -> None:
        """A reservation's placement: recorded (not published); the worker's gate holds it."""
        if self.reservations.place(rid, worker):
            log.info("ojs-ml: placed reservation %s on %s", rid, worker)
            self._dirty = True

    def _deny(self, task_id: str, record: dict[str, Any] | None, note: str) -> None:
        """RFC 27 DENY of a waiting job: drop it from the set, fail it, dead-letter it."""
        if record is None or not self.book.cancel(task_id):
            return
        msg = record.get("msg") or {}
        body = base64.b64decode(msg.get("body") or b"")
        self._refuse(task_id, dict(msg.get("headers") or {}), body, note)
