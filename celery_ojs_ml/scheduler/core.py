"""`schedule(pending, fleet, now)`: one pass of the fleet policy, pure and clock-injected.

Key decision: jobs are decided one at a time in fleet order, each against the fleet
as the jobs before it left it, with four outcomes tried in turn: **start now** on the
best-scoring worker where it fits (on a reserved worker only if it leaves the
reservation its capacity: backfill); **preempt** lower-band work (only when it fits
nowhere now); **reserve** the worker where it can start soonest, for the first
`reservation_depth` jobs that get this far (Slurm's reservation plus backfill);
**estimate** its start for everyone else (a shadow reservation backfill ignores).
A gang is one job at its first rank's place, all ranks or none (`scheduler.gang`).
A long job whose start now would hold a large worker from draining is decided after
the pass's other jobs (`scheduler.defer`). With `Policy.queue_depth` a pass decides
only the first that many jobs, with the decisions of a full pass over those alone; the
rest wait for a deeper one. The pass keeps nothing;
`Planner` is the same pass one job at a time (for callers that stop early or time it).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from celery_ojs_ml.allocator.model import rank
from celery_ojs_ml.scheduler.annotate import Annotator
from celery_ojs_ml.scheduler.budget import BudgetBook
from celery_ojs_ml.scheduler.defer import Deferrals
from celery_ojs_ml.scheduler.escalate import escalate_all
from celery_ojs_ml.scheduler.estimate import Estimator
from celery_ojs_ml.scheduler.fair import holdings, pass_order
from celery_ojs_ml.scheduler.fleet import FleetView
from celery_ojs_ml.scheduler.gang import Gang, place_now, ready_gangs, start_at
from celery_ojs_ml.scheduler.memo import Memo, names_worker
from celery_ojs_ml.scheduler.model import (
    DEFAULT_POLICY,
    Annotation,
    Assignment,
    Decision,
    Denial,
    PendingJob,
    Policy,
    Preemption,
    Reservation,
    WorkerState,
)
from celery_ojs_ml.scheduler.order import Ask, Asks, OrderKey
from celery_ojs_ml.scheduler.pools import (
    PREFIX,
    ReservationPool,
    hold,
    open_queues,
    with_pools,
)
from celery_ojs_ml.scheduler.preempt import Preemptor, inflight_preemptions
from celery_ojs_ml.scheduler.score import PlacementScore, Workload
from celery_ojs_ml.scheduler.settle import settling
from celery_ojs_ml.scheduler.slot import Hold, HoldKind, Slot, running_vec
from celery_ojs_ml.scheduler.vectors import sum_of


def schedule(
    pending: Iterable[PendingJob],
    fleet: Sequence[WorkerState],
    now: float,
    policy: Policy = DEFAULT_POLICY,
    *,
    memo: Memo | None = None,
    inflight: Iterable[tuple[str, int]] = (),
    pools: Sequence[ReservationPool] = (),
    usage: Mapping[str, float] | None = None,
) -> Decision:
    """Decide every pending job once, in fleet order (see module doc).

    `inflight`: (queue, GPUs) of jobs assigned but not yet among the fleet's
    running jobs; they count against their queue's budget (§10.3) and its
    fair share. `pools`: the dynamic reservations (§8.3); see `scheduler.pools`.
    `usage`: each queue's decayed mean of GPUs held (`scheduler.usage`), counted
    in fair order with `Policy.fair_share_half_life_s`.
    """
    jobs, raised = escalate_all(pending, now)
    held = {p.rid: p for p in pools}
    general = [j for j in jobs if j.req.ext_ml_reservation_id not in held and j.gang is None]
    gangs, waiting = ready_gangs((j for j in jobs if j.gang is not None), now)
    general += [g.lead for g in gangs.values()]  # a gang takes its lead's place in order
    if held:
        fleet = open_queues(hold(fleet, held.values(), now), memo)
        general += [p.as_job() for p in held.values() if p.worker is None and not p.ended]
    inflight = list(inflight)
    ordered, orders = pass_order(general, fleet, inflight, policy, usage)
    planner = Planner(fleet, now, policy, pending=ordered, memo=memo, inflight=inflight)
    planner.orders = orders
    planner.escalated = raised
    for job in ordered[: policy.queue_depth]:
        if planner.settled(job):
            break  # this job and every one after it can only wait (`Policy.settle`)
        if job.gang is None:
            planner.decide(job)
        else:
            planner.decide_gang(gangs[job.gang])
    return with_pools(planner.decision(), waiting, jobs, held, fleet, now)


class _Waiting:
    """A job left waiting, with what its annotation needs."""

    __slots__ = ("ask", "deny", "note", "reason", "t_estimate", "worker")

    def __init__(self, ask: Ask, t: float | None, worker: str | None, note: str = "") -> None:
        self.ask, self.t_estimate, self.worker, self.note = ask, t, worker, note
        self.deny = False
        self.reason = ""
        """A reason that replaces matching's (a budget)."""


class Planner:
    """One pass, one job at a time; feed jobs in fleet order, then take the `decision`."""

    def __init__(
        self,
        fleet: Sequence[WorkerState],
        now: float,
        policy: Policy = DEFAULT_POLICY,
        *,
        pending: Sequence[PendingJob] = (),
        memo: Memo | None = None,
        inflight: Iterable[tuple[str, int]] = (),
    ) -> None:
        self.now, self.policy = now, policy
        self._asks = Asks(now)
        self.budgets = BudgetBook(dict(policy.budgets), [*holdings(fleet), *inflight])
        alike = _by_requirements(pending)
        exact = any(names_worker(job.req) for job, _ in alike)
        workload = Workload.of_pass(fleet, alike)
        self.view = FleetView(fleet, now, policy, workload, memo=memo, exact=exact)
        self.estimator = Estimator(self.view)
        self.preemptor = Preemptor(self.view)
        young = replace(policy, min_runtime_before_preemption_s=0.0)
        self._later = Preemptor(self.view, young)  # plans that wait for victims to age
        self._later_at: dict[tuple[str, str, str, str], float | None] = {}
        self._placeables: dict[tuple[str, str], bool] = {}
        self._inflight = inflight_preemptions(self.view.slots)
        self.deferrals = Deferrals(self.view, now, policy.drain_defer_s)
        self._settles, self._lowest = settling(policy, alike, self._inflight, self.view.slots)
        self._open = (-1, True)  # (assignments made when last checked, a GPU free then)
        self._assignments: list[Assignment] = []
        self._reservations: list[Reservation] = []
        self._planned: list[Reservation] = []
        self._preemptions: list[Preemption] = []
        self._waiting: list[_Waiting] = []
        self._reserved = 0
        self._estimated = 0
        self.orders: dict[str, OrderKey] = {}
        """Fair-share order keys by task id (`scheduler.fair`); others keep fleet order."""
        self.escalated: dict[str, str] = {}
        """Jobs escalated in this pass (§8.4): task id -> the band they were submitted in."""

    def decide(self, job: PendingJob) -> None:
        """Assign, preempt for, reserve for or estimate `job` (see module doc)."""
        ask = self._asks.of(job, self.orders.get(job.task_id))
        over = self.budgets.blocks(job.queue, _gpus(job))
        if over is not None:  # waits without reserving or preempting (§10.3)
            waiting = _Waiting(ask, None, None)
            waiting.reason = over
            self._waiting.append(waiting)
            return
        if job.not_before > self.now:  # sitting out a back-off: its place, not a start
            self._reserve_or_estimate(ask)
            return
        found = self.view.fit_now(ask, self.deferrals.second_turn)
        if found is not None:
            if not self.deferrals.defers(ask, found[0]):
                self._assign(ask, *found)
        elif not self._placeable(job):
            self._unplaceable(ask)
        elif job.task_id.startswith(PREFIX) or not (  # a reservation never preempts (§8.3)
            self._await_victims(ask) or self._preempt(ask)
        ):
            self._reserve_or_estimate(ask)

    def finish(self) -> None:
        """Decide the jobs deferred so far (`scheduler.defer`), in fleet order, once the
        pass's other jobs are decided (`decision` does it first)."""
        for job in self.deferrals.take():
            self.decide(job)

    def decide_gang(self, gang: Gang) -> None:
        """Start every rank of `gang` now, or reserve (or estimate) when all can start
        (`scheduler.gang`); over its queue's budget it waits, holding nothing (§10.3)."""
        order = self.orders.get(gang.lead.task_id, gang.lead.order)
        asks = [self._asks.of(j, order) for j in gang.ranks]
        over = self.budgets.blocks(gang.lead.queue, gang.gpus, len(asks))
        found = place_now(self.view, asks) if over is None else over
        if not isinstance(found, str):
            for ask, slot in found:
                group = self.view.groups[slot.group]
                self._assign(ask, slot, self.view.score(ask, group, slot.shape()))
            return
        start = None if over is not None else start_at(self.view, self.estimator, asks)
        at, where = start if start is not None else (None, [])
        firm = start is not None and self._reserved < self.policy.reservation_depth
        self._reserved += firm
        slots = {a.job.task_id: s for a, s in where}
        for ask in asks:
            held = slots.get(ask.job.task_id) if firm else None
            if held is not None and at is not None:
                self._hold(ask, held, at, "reserve")
                self._reservations.append(Reservation(ask.job.task_id, held.name, at))
                self._planned.append(self._reservations[-1])
                self.budgets.take(ask.job.queue, _gpus(ask.job))
            waiting = _Waiting(ask, at, None if held is None else held.name)
            waiting.reason = over or f"gang {gang.gid}: {found}"
            self._waiting.append(waiting)

    def settled(self, job: PendingJob) -> bool:
        """Whether `job` and every job after it in order can only wait (`Policy.settle`).

        Every pending job needs whole GPUs (`settle.may_settle`) and no worker has one free,
        so none can start or backfill; the reservations are all taken, so none
        reserves; and nothing running is in a band below `job`'s, so neither it nor a
        later job (fleet order puts bands first) can preempt. Free capacity only
        shrinks during a pass, so the check is redone only after an assignment."""
        if not self._settles or self._reserved < self.policy.reservation_depth:
            return False
        if rank(job.band) > self._lowest:
            return False
        made = len(self._assignments)
        if self._open[0] != made:
            free = any(s.state.available and s.free[0] >= 1 for s in self.view.slots)
            self._open = (made, free)
        return not self._open[1]

    def _assign(self, ask: Ask, slot: Slot, score: PlacementScore) -> None:
        self.view.assign(ask, slot)
        self.budgets.take(ask.job.queue, _gpus(ask.job))
        self._assignments.append(Assignment(ask.job.task_id, slot.name, score.total))

    def _placeable(self, job: PendingJob) -> bool:
        """Whether an available worker could ever run the job (kept by class and queue)."""
        key = (job.class_key, job.queue)
        hit = self._placeables.get(key)
        if hit is None:
            hit = self._placeables[key] = any(g.members for g in self.view.eligible(job))
        return hit

    def _unplaceable(self, ask: Ask) -> None:
        """No available worker could ever run it: wait (a worker may come) or deny."""
        waiting = _Waiting(ask, None, None)
        known = any(g.away for g in self.view.eligible(ask.job))
        waiting.deny = self.policy.deny_unsatisfiable and not known
        self._waiting.append(waiting)

    def _await_victims(self, ask: Ask) -> bool:
        """A preemption for this job is in flight: pass it what its victims free."""
        inflight = self._inflight.get(ask.job.task_id)
        if inflight is None:
            return False
        slot, victims = inflight
        freed = sum_of(running_vec(v) for v in victims)
        if not slot.state.available or not self.view.claim(ask, slot, freed):
            return False
        self._preempting(ask, slot, tuple(v.task_id for v in victims))
        return True

    def _preempt(self, ask: Ask) -> bool:
        plan = self.preemptor.plan(ask)
        if plan is None:
            return False
        slot = plan.slot
        if not self.view.claim(ask, slot, sum_of(running_vec(v) for v in plan.victims)):
            return False
        self.view.preempt(slot, list(plan.victims))
        self.estimator.refresh(slot)
        victims = tuple(v.task_id for v in plan.victims)
        self._preemptions.append(Preemption(ask.job.task_id, slot.name, victims))
        self.budgets.take(ask.job.queue, _gpus(ask.job))
        self._preempting(ask, slot, victims)
        return True

    def _preempting(self, ask: Ask, slot: Slot, victims: tuple[str, ...]) -> None:
        note = f"preempting {', '.join(victims)} on {slot.name}"
        start = self.now + self.policy.preemption_grace_s
        self._waiting.append(_Waiting(ask, start, slot.name, note))

    def _reserve_or_estimate(self, ask: Ask) -> None:
        firm = self._reserved < self.policy.reservation_depth
        preempts = not ask.job.task_id.startswith(PREFIX)  # a reservation never does
        found = self.estimator.exact(ask, preempts) if firm else self._estimate(ask)
        preemptible_at = self._preemptible_at(ask)  # before its own hold makes the worker taken
        if firm:
            self._reserved += 1
            self._reserve(ask, found)
            # its budget is held too, or later jobs of its queue could use it up meanwhile
            self.budgets.take(ask.job.queue, _gpus(ask.job))
        elif found is not None:
            start, slot = found
            self._hold(ask, slot, start, "shadow")
            self._planned.append(Reservation(ask.job.task_id, slot.name, start))
            self._waiting.append(_Waiting(ask, start, None))
        else:
            self._waiting.append(_Waiting(ask, None, None))
        waiting = self._waiting[-1]
        waiting.t_estimate = _sooner(waiting.t_estimate, preemptible_at)

    def _estimate(self, ask: Ask) -> tuple[float, Slot] | None:
        """The soonest start of a job past the reserved ones, for the first
        `estimate_depth` of them (`Policy.estimate_depth`); None past that."""
        depth = self.policy.estimate_depth
        if depth is not None and self._estimated >= depth:
            return None
        self._estimated += 1
        return self.estimator.soonest(ask)

    def _preemptible_at(self, ask: Ask) -> float | None:
        """When victims now too young would let the job preempt, plus the grace period."""
        job = ask.job
        key = (job.class_key, job.queue, job.band, job.gpu_affinity)
        if key not in self._later_at:
            plan = self._later.plan(ask)
            age = self.policy.min_runtime_before_preemption_s
            aged = None if plan is None else max(v.started_at + age for v in plan.victims)
            if aged is None or aged == math.inf:  # no plan, or a victim's start is unknown
                self._later_at[key] = None
            else:
                self._later_at[key] = max(aged, self.now) + self.policy.preemption_grace_s
        return self._later_at[key]

    def _reserve(self, ask: Ask, found: tuple[float, Slot] | None) -> None:
        """A firm reservation; with no known start, hold the worker that lacks least now."""
        start: float | None
        if found is not None:
            start, slot = found
        else:
            start, drain = None, self.estimator.drain_target(ask)
            if drain is None:
                self._waiting.append(_Waiting(ask, None, None))
                return
            slot = drain
        self._hold(ask, slot, self.now if start is None else start, "reserve")
        self._reservations.append(Reservation(ask.job.task_id, slot.name, start))
        self._planned.append(self._reservations[-1])
        self._waiting.append(_Waiting(ask, start, slot.name))

    def _hold(self, ask: Ask, slot: Slot, start: float, kind: HoldKind) -> None:
        limit = ask.job.time_limit_s
        end = None if limit is None else start + limit
        amount = self.estimator.need(ask, slot)
        self.view.hold(slot, Hold(ask.job.task_id, ask.order, start, end, amount, kind))

    def decision(self) -> Decision:
        """What the pass decided, with every waiting job annotated."""
        self.finish()
        annotator = Annotator(self.view)
        annotations: dict[str, Annotation] = {}
        denials: list[Denial] = []
        for w in self._waiting:
            reason = w.reason or annotator.reason(w.ask)
            if w.deny:
                denials.append(Denial(w.ask.job.task_id, reason, unplaceable=True))
                continue
            if w.note:
                reason = f"{reason}; {w.note}"
            was = self.escalated.get(w.ask.job.task_id)
            if was is not None:
                reason = f"{reason}; escalated from {was} to {w.ask.job.band} (§8.4)"
            annotations[w.ask.job.task_id] = Annotation(
                w.ask.job.task_id, reason, w.t_estimate, w.worker
            )
        return Decision(
            tuple(self._assignments),
            annotations,
            tuple(self._reservations),
            tuple(self._preemptions),
            tuple(denials),
            self.budgets.report(),
            dict(self.escalated),
            tuple(self._planned),
        )


def _by_requirements(pending: Sequence[PendingJob]) -> list[tuple[PendingJob, int]]:
    """One job per distinct requirements object, with how many share it: the admission
    parses identical declarations into one object, so 10,000 jobs are a handful here."""
    counts = Counter(id(j.req) for j in pending)
    first = {id(j.req): j for j in pending}
    return [(first[key], n) for key, n in counts.items()]


def _gpus(job: PendingJob) -> int:
    return int(job.req.ext_ml_gpu_count or 0)


def _sooner(a: float | None, b: float | None) -> float | None:
    """The earlier of two estimates; None is unknown."""
    if a is None or b is None:
        return a if b is None else b
    return min(a, b)
