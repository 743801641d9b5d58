"""Preemption planned fleet-wide: which worker, and which of its jobs, lose least work.

Key decisions:

* **Who may be preempted** is the allocator's rule (`allocator.policy.is_victim`)
  plus two fleet rules (`may_preempt`): a job younger than
  `min_runtime_before_preemption_s`, or whose preemption policy is `never`, is exempt.
* **Least work lost.** On each worker, candidates are taken lowest band first, then
  least progress since their last committed checkpoint, then fewest GPUs, and pruned
  to a minimal set; across workers the cheapest plan wins (`plan_cost`).
* A worker already reserved for a job ahead, or already preempting for one,
  is never a preemption target: its capacity is promised.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from celery_ojs_ml.allocator.model import rank
from celery_ojs_ml.allocator.policy import minimal_set
from celery_ojs_ml.matching import Verdict, match
from celery_ojs_ml.scheduler.fleet import FleetView
from celery_ojs_ml.scheduler.model import Policy, RunningJob
from celery_ojs_ml.scheduler.order import Ask
from celery_ojs_ml.scheduler.slot import Slot, running_vec
from celery_ojs_ml.scheduler.vectors import Vec, covers, finite, plus, sum_of, to_free

Cost = tuple[int, float, float, int]


@dataclass(frozen=True, slots=True)
class Plan:
    """Preempt `victims` on `slot` so the job fits there."""

    slot: Slot
    victims: tuple[RunningJob, ...]
    cost: Cost


def may_preempt(victim: RunningJob, band: str, *, now: float, policy: Policy) -> bool:
    """Whether a job in `band` may preempt `victim` now (see module doc).

    A preemptible job of a lower band; on-demand only for a reserved job and only when
    `allow_on_demand_preemption`. A job younger than `min_runtime_before_preemption_s`
    is exempt (Slurm's `PreemptExemptTime`, so a stream of short high-band jobs cannot
    thrash a long spot job), and so is one whose `ext_mlx_scheduling_preemption_policy`
    is `never`.
    """
    if not victim.preemptible or victim.preemption_policy == "never":
        return False
    if victim.preempted_for is not None or rank(victim.band) >= rank(band):
        return False
    if victim.band == "on-demand" and not policy.allow_on_demand_preemption:
        return False
    return now - victim.started_at >= policy.min_runtime_before_preemption_s


def lost_work_s(victim: RunningJob, now: float) -> float:
    """Seconds of progress since the victim's last committed checkpoint (or its start)."""
    since = victim.started_at
    if victim.last_checkpoint_at is not None:
        since = max(since, victim.last_checkpoint_at)
    return max(now - since, 0.0)


def victim_order(victim: RunningJob, now: float) -> tuple[int, float, int, str]:
    """Lowest band, then least progress lost, then fewest GPUs (then task id)."""
    return (rank(victim.band), lost_work_s(victim, now), victim.gpus, victim.task_id)


def plan_cost(victims: Sequence[RunningJob], now: float, slot: Slot) -> Cost:
    """Highest victim band, progress lost, GPUs preempted, worker (smaller is better)."""
    return (
        max(rank(v.band) for v in victims),
        sum(lost_work_s(v, now) for v in victims),
        sum(v.gpus for v in victims),
        slot.idx,
    )


class Preemptor:
    """Finds the cheapest preemption plan for a job over the whole fleet.

    Workers are visited by a lower bound of their plan's cost (the lowest band
    and the least progress among their candidates), so the search stops as
    soon as no unvisited worker can beat the best plan found. The search of
    each kind of job resumes where the last one of its kind stopped, since a
    pass only takes capacity away: a worker visited before is planned again
    only when it changed and its old plan is the cheapest known. On a worker, victims
    are taken in `victim_order` until the job fits; then each, the last taken first,
    is spared again if the job still fits without it, so the set is minimal.
    """

    def __init__(self, view: FleetView, policy: Policy | None = None) -> None:
        self.view = view
        self.policy = policy or view.policy
        self._hopeless: set[tuple[object, ...]] = set()
        self._candidates: dict[tuple[int, str], list[RunningJob]] = {}
        self._orders: dict[tuple[object, ...], list[tuple[Cost, int]]] = {}
        self._shared: dict[tuple[str, tuple[int, ...]], list[tuple[Cost, int]]] = {}
        self._by_band: dict[str, list[tuple[Cost, int]]] = {}
        self._searches: dict[tuple[object, ...], _Search] = {}

    def plan(self, ask: Ask) -> Plan | None:
        """The plan that loses least work, or None (remembered for alike jobs this pass)."""
        if not self.policy.preemption or rank(ask.job.band) == 0:
            return None
        job = ask.job
        key = (job.class_key, job.queue, job.band, job.gpu_affinity)
        if key in self._hopeless:
            return None
        search = self._searches.get(key)
        if search is None:
            search = self._searches[key] = _Search(self._order(key, ask))
        best = self._best_seen(ask, search)
        order, found = search.order, search.found
        while search.next < len(order):
            bound, idx = order[search.next]
            if best is not None and bound >= best.cost:
                break
            search.next += 1
            plan = self._on(ask, self.view.slots[idx])
            if plan is not None:
                heapq.heappush(found, (plan.cost, idx, plan.slot.version, plan))
                best = plan if best is None or plan.cost < best.cost else best
        if best is None:
            self._hopeless.add(key)  # a pass only takes capacity away: alike jobs fail too
        return best

    def _best_seen(self, ask: Ask, search: _Search) -> Plan | None:
        """The cheapest plan on the workers visited so far, planned again where they changed
        (a change only takes capacity away: the plan costs more, or there is none)."""
        heap = search.found
        while heap:
            _, idx, version, plan = heap[0]
            slot = self.view.slots[idx]
            if version == slot.version:
                return plan
            again = self._on(ask, slot)
            if again is None:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (again.cost, idx, slot.version, again))
        return None

    def _order(self, key: tuple[object, ...], ask: Ask) -> list[tuple[Cost, int]]:
        """Eligible workers with candidates, by the lower bound of their plan's cost.

        Kinds of job with the same band and eligible groups share one list: the fleet's
        workers ranked once per band (`_ranked`), kept to those groups' members."""
        hit = self._orders.get(key)
        if hit is None:
            band, groups = ask.job.band, self.view.eligible(ask.job)
            shared = (band, tuple(g.idx for g in groups))
            hit = self._shared.get(shared)
            if hit is None:
                members = {i for g in groups for i in g.members}
                hit = [entry for entry in self._ranked(band) if entry[1] in members]
                self._shared[shared] = hit
            self._orders[key] = hit
        return hit

    def _ranked(self, band: str) -> list[tuple[Cost, int]]:
        """Every available worker with candidates for `band`, by its plan's lower bound
        (the index breaks ties, so a subset keeps its order)."""
        hit = self._by_band.get(band)
        if hit is None:
            hit = []
            now = self.view.now
            for group in self.view.groups:
                for idx in group.members:
                    found = self._candidates_on(self.view.slots[idx], band)
                    if found:
                        low = min(rank(v.band) for v in found)
                        hit.append(((low, min(lost_work_s(v, now) for v in found), 0, idx), idx))
            hit.sort()
            self._by_band[band] = hit
        return hit

    def _candidates_on(self, slot: Slot, band: str) -> list[RunningJob]:
        """Jobs on `slot` that `band` may preempt, in victim order (once per pass)."""
        key = (slot.idx, band)
        hit = self._candidates.get(key)
        if hit is None:
            now, policy = self.view.now, self.policy
            hit = [r for r in slot.state.running if may_preempt(r, band, now=now, policy=policy)]
            hit.sort(key=lambda r: victim_order(r, now))
            self._candidates[key] = hit
        return hit

    def _on(self, ask: Ask, slot: Slot) -> Plan | None:
        if slot.reserved or slot.victims or slot.exclusive or (ask.dedicated and slot.assigned):
            return None
        candidates = self._candidates_on(slot, ask.job.band)
        want = finite(slot.capacity) if ask.dedicated else ask.want
        if not candidates or not covers(_freed(slot.free, candidates), want):
            return None
        victims = minimal_set(candidates, lambda vs: self._fits(ask, slot, vs, want))
        if not victims:
            return None
        return Plan(slot, tuple(victims), plan_cost(victims, self.view.now, slot))

    def _fits(self, ask: Ask, slot: Slot, victims: Sequence[RunningJob], want: Vec) -> bool:
        """Counted resources suffice; only anti-affinity needs the full match (WAIT reasons)."""
        free = _freed(slot.free, victims)
        if not covers(free, want):
            return False
        if ask.dedicated and len(victims) < len(slot.state.running):
            return False
        if ask.job.req.ext_ml_anti_affinity is None:
            return True
        gone = {v.task_id for v in victims}
        kept = [r.labels for r in slot.state.running if r.labels and r.task_id not in gone]
        labels = (*kept, *slot.added_labels)
        found = match(ask.job.req, slot.state.caps, to_free(free, labels), locality_weight=0)
        return found.verdict is Verdict.FITS


@dataclass(slots=True)
class _Search:
    """One kind of job's search of the fleet in a pass: workers by the lower bound of
    their plan's cost, how many were visited, and the plans found on them (a heap)."""

    order: list[tuple[Cost, int]]
    next: int = 0
    found: list[tuple[Cost, int, int, Plan]] = field(default_factory=list)


def _freed(free: Vec, victims: Sequence[RunningJob]) -> Vec:
    return plus(free, sum_of(running_vec(v) for v in victims))


def inflight_preemptions(slots: Sequence[Slot]) -> dict[str, tuple[Slot, list[RunningJob]]]:
    """Preemptions in flight: preempting task id -> (worker, victims)."""
    out: dict[str, tuple[Slot, list[RunningJob]]] = {}
    for slot in slots:
        for victim in slot.victims.values():
            if victim.preempted_for is not None:
                out.setdefault(victim.preempted_for, (slot, []))[1].append(victim)
    return out
