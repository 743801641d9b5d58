"""`schedule(pending, fleet, now)`: one pass of the fleet policy, pure and clock-injected.

Key decision: jobs are decided one at a time in fleet order, each against the fleet
as the jobs before it left it, with four outcomes tried in turn: **start now** on the
best-scoring worker where it fits (on a reserved worker only if it leaves the
reservation its capacity: backfill); **preempt** lower-band work (only when it fits
nowhere now); **reserve** the worker where it can start soonest, for the first
`reservation_depth` jobs that get this far (Slurm's reservation plus backfill);
**estimate** its start for everyone else (a shadow reservation backfill ignores).
With `Policy.queue_depth` a pass decides only the first that many jobs, with exactly
the decisions of a full pass; the rest wait for a deeper one. The pass keeps nothing;
`Planner` is the same pass one job at a time (for callers that stop early or time it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from celery_ojs_ml.allocator.model import rank
from celery_ojs_ml.scheduler.annotate import Annotator
from celery_ojs_ml.scheduler.budget import BudgetBook
from celery_ojs_ml.scheduler.escalate import escalate_all
from celery_ojs_ml.scheduler.estimate import Estimator
from celery_ojs_ml.scheduler.fair import fair_order, held_gpus, holdings
from celery_ojs_ml.scheduler.fleet import FleetView, Memo
from celery_ojs_ml.scheduler.frag import Kind, kind_of
from celery_ojs_ml.scheduler.gang import Ganged, place_gangs
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
    RunningJob,
    WorkerState,
)
from celery_ojs_ml.scheduler.order import Ask, OrderKey, in_order
from celery_ojs_ml.scheduler.pools import (
    PREFIX,
    Filled,
    ReservationPool,
    fill,
    hold,
    open_queues,
)
from celery_ojs_ml.scheduler.preempt import Preemptor
from celery_ojs_ml.scheduler.score import PlacementScore, Workload
from celery_ojs_ml.scheduler.settle import settling
from celery_ojs_ml.scheduler.slot import Hold, HoldKind, Slot, running_vec
from celery_ojs_ml.scheduler.vectors import sum_of
from celery_ojs_ml.spec.resources import MLRequirements


def schedule(
    pending: Iterable[PendingJob],
    fleet: Sequence[WorkerState],
    now: float,
    policy: Policy = DEFAULT_POLICY,
    *,
    memo: Memo | None = None,
    inflight: Iterable[tuple[str, int]] = (),
    pools: Sequence[ReservationPool] = (),
) -> Decision:
    """Decide every pending job once, in fleet order (see module doc).

    `inflight`: (queue, GPUs) of jobs assigned but not yet among the fleet's
    running jobs; they count against their queue's budget (§10.3) and its
    fair share. `pools`: the dynamic reservations (§8.3); see `scheduler.pools`.
    """
    jobs, raised = escalate_all(pending, now)
    held = {p.rid: p for p in pools}
    general = [j for j in jobs if j.req.ext_ml_reservation_id not in held and j.gang is None]
    ranks = (j for j in jobs if j.gang is not None and j.not_before <= now)  # backed off: later
    ganged = place_gangs(ranks, fleet, now)
    fleet = ganged.fleet
    if held:
        fleet = open_queues(hold(fleet, held.values(), now))
        general += [p.as_job() for p in held.values() if p.worker is None and not p.ended]
    inflight = list(inflight)
    ordered, orders = _ordered(general, fleet, inflight, policy)
    planner = Planner(fleet, now, policy, pending=ordered, memo=memo, inflight=inflight)
    planner.orders = orders
    planner.escalated = raised
    for job in ordered[: policy.queue_depth]:
        if planner.settled(job):
            break  # this job and every one after it can only wait (`Policy.settle`)
        planner.decide(job)
    return _merged(planner.decision(), ganged, jobs, held, fleet, now)


def _merged(
    decision: Decision,
    ganged: Ganged,
    jobs: Sequence[PendingJob],
    held: Mapping[str, ReservationPool],
    fleet: Sequence[WorkerState],
    now: float,
) -> Decision:
    """The general jobs' decision with the gangs placed first and the jobs inside the
    reservations (§8.3) placed in their pools."""
    inside = [
        j
        for j in jobs
        if j.req.ext_ml_reservation_id in held and j.gang is None and j.not_before <= now
    ]
    filled = fill(inside, held, fleet) if held else Filled([], {}, [])
    if not (ganged.assignments or ganged.annotations or held):
        return decision
    return replace(
        decision,
        assignments=(*ganged.assignments, *filled.assignments, *decision.assignments),
        annotations={**decision.annotations, **filled.annotations, **ganged.annotations},
        denials=(*decision.denials, *filled.denials),
    )


def _ordered(
    jobs: list[PendingJob],
    fleet: Sequence[WorkerState],
    inflight: list[tuple[str, int]],
    policy: Policy,
) -> tuple[list[PendingJob], dict[str, OrderKey]]:
    """The waiting jobs in the order a pass decides them, with their fair-share keys:
    fleet order, or fair order with weights (`scheduler.fair`)."""
    ordered = in_order(jobs)
    orders: dict[str, OrderKey] = {}
    if policy.weights:  # fair sharing between queues (scheduler.fair)
        fair = fair_order(ordered, held_gpus(fleet, inflight), dict(policy.weights))
        ordered = [job for job, _ in fair]
        orders = {job.task_id: key for job, key in fair}
    return ordered, orders


def names_worker(req: MLRequirements) -> bool:
    """Whether a hard constraint names the `worker_id` label (then workers are not grouped)."""
    if req.ext_ml_node_selector and "worker_id" in req.ext_ml_node_selector:
        return True
    specs = (req.ext_ml_affinity, req.ext_ml_anti_affinity)
    return any(r.key == "worker_id" for s in specs if s for r in s.required)


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
        self.budgets = BudgetBook(dict(policy.budgets), [*holdings(fleet), *inflight])
        largest = max((w.caps.gpu_count for w in fleet), default=0)
        sizes = {w.caps.gpu_count for w in fleet}
        alike = _by_requirements(pending)
        kinds: Counter[Kind] = Counter()
        for job, n in alike:
            kinds[kind_of(job)] += n
        workload = Workload.of_counts(kinds, largest, sizes)
        exact = any(names_worker(job.req) for job, _ in alike)
        self.view = FleetView(fleet, now, policy, workload, memo=memo, exact=exact)
        self.estimator = Estimator(self.view)
        self.preemptor = Preemptor(self.view)
        young = replace(policy, min_runtime_before_preemption_s=0.0)
        self._later = Preemptor(self.view, young)  # plans that wait for victims to age
        self._later_at: dict[tuple[str, str, str, str], float | None] = {}
        self._inflight = _inflight(self.view.slots)
        self._settles, self._lowest = settling(policy, alike, self._inflight, self.view.slots)
        self._open = (-1, True)  # (assignments made when last checked, a GPU free then)
        self._assignments: list[Assignment] = []
        self._reservations: list[Reservation] = []
        self._planned: list[Reservation] = []
        self._preemptions: list[Preemption] = []
        self._waiting: list[_Waiting] = []
        self._reserved = 0
        self.orders: dict[str, OrderKey] = {}
        """Fair-share order keys by task id (`scheduler.fair`); others keep fleet order."""
        self.escalated: dict[str, str] = {}
        """Jobs escalated in this pass (§8.4): task id -> the band they were submitted in."""

    def decide(self, job: PendingJob) -> None:
        """Assign, preempt for, reserve for or estimate `job` (see module doc)."""
        ask = Ask.of(job, self.now, self.orders.get(job.task_id))
        over = self.budgets.blocks(job.queue, _gpus(job))
        if over is not None:  # waits without reserving or preempting (§10.3)
            waiting = _Waiting(ask, None, None)
            waiting.reason = over
            self._waiting.append(waiting)
            return
        if job.not_before > self.now:  # sitting out a back-off: its place, not a start
            self._reserve_or_estimate(ask)
            return
        found = self.view.fit_now(ask)
        if found is not None:
            self._assign(ask, *found)
        elif not any(g.members for g in self.view.eligible(job)):
            self._unplaceable(ask)
        elif job.task_id.startswith(PREFIX) or not (  # a reservation never preempts (§8.3)
            self._await_victims(ask) or self._preempt(ask)
        ):
            self._reserve_or_estimate(ask)

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
        slot.preempt(list(plan.victims))
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
        found = self.estimator.exact(ask) if firm else self.estimator.soonest(ask)
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

    def _preemptible_at(self, ask: Ask) -> float | None:
        """When victims now too young would let the job preempt, plus the grace period."""
        job = ask.job
        key = (job.class_key, job.queue, job.band, job.gpu_affinity)
        if key not in self._later_at:
            plan = self._later.plan(ask)
            age = self.policy.min_runtime_before_preemption_s
            aged = None if plan is None else max(v.started_at + age for v in plan.victims)
            self._later_at[key] = (
                None if aged is None else max(aged, self.now) + self.policy.preemption_grace_s
            )
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
        annotator = Annotator(self.view)
        annotations: dict[str, Annotation] = {}
        denials: list[Denial] = []
        for w in self._waiting:
            reason = w.reason or annotator.reason(w.ask)
            if w.deny:
                denials.append(Denial(w.ask.job.task_id, reason))
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


def _inflight(slots: Sequence[Slot]) -> dict[str, tuple[Slot, list[RunningJob]]]:
    """Preemptions in flight: preempting task id -> (worker, victims)."""
    out: dict[str, tuple[Slot, list[RunningJob]]] = {}
    for slot in slots:
        for victim in slot.victims.values():
            if victim.preempted_for is not None:
                out.setdefault(victim.preempted_for, (slot, []))[1].append(victim)
    return out
