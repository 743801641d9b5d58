"""The fleet during one pass, grouped into equivalence classes so a decision stays cheap.

Key decision (after Kubernetes' equivalence classes): workers with the same
capabilities (worker id aside) and logical queues form a group; within a
group, workers with the same free shape (free vector, running labels, idle)
are interchangeable for matching and scoring. So `match` runs once per
(requirement class, group, shape), not once per worker, and "which groups can
ever run this class" is remembered across passes in a `Memo`. Workers that
carry a reservation leave their shape bucket: each needs its own backfill
check against its timeline. The start-now search keeps fit checks by (job needs, group,
shape) and picks by (bucket, job end) until the bucket changes (`candidates`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from celery_ojs_ml.allocator.sharing import FULL, share_milli
from celery_ojs_ml.matching import FreeCapacity, MatchResult, Verdict, match
from celery_ojs_ml.matching import score as soft_score
from celery_ojs_ml.scheduler.candidates import (
    BestBuckets,
    Candidate,
    Group,
    Key,
    Rank,
    RankKey,
    Ties,
    share_fits,
    taken_on,
    wants_link,
)
from celery_ojs_ml.scheduler.drains import Drains
from celery_ojs_ml.scheduler.memo import Memo as Memo  # `scheduler.Memo` comes from here
from celery_ojs_ml.scheduler.model import PendingJob, Policy, RunningJob, WorkerState
from celery_ojs_ml.scheduler.nofit import NoFit
from celery_ojs_ml.scheduler.order import Ask
from celery_ojs_ml.scheduler.score import PlacementScore, Workload, placement
from celery_ojs_ml.scheduler.slot import Hold, Shape, Slot
from celery_ojs_ml.scheduler.timefit import aligned, large, late_on, offer_in_time, plain
from celery_ojs_ml.scheduler.vectors import (
    Vec,
    clip,
    covers,
    finite,
    lowest,
    minus,
    plus,
    to_free,
    totals_of,
)
from celery_ojs_ml.spec.resources import gpu_share


class FleetView:
    """Slots, groups and the caches one pass shares (see module doc)."""

    def __init__(
        self,
        fleet: Sequence[WorkerState],
        now: float,
        policy: Policy,
        workload: Workload,
        *,
        memo: Memo | None = None,
        exact: bool = False,
    ) -> None:
        self.now, self.policy, self.workload = now, policy, workload
        self.memo = memo or Memo()
        self.slots = [Slot(i, w, now, policy) for i, w in enumerate(fleet)]
        self.groups: list[Group] = []
        self._exact = exact
        self._eligible: dict[tuple[str, str], tuple[Group, ...]] = {}
        self._verdicts: dict[tuple[str, int, Shape], MatchResult] = {}
        self._scores: dict[tuple[Hashable, ...], PlacementScore] = {}
        self._frees: dict[Shape, FreeCapacity] = {}
        self._ask_ids: dict[Hashable, int] = {}
        self._fit_scores: dict[tuple[int, int, int], tuple[Shape, PlacementScore | None]] = {}
        self._lowest: dict[tuple[int, float | None], tuple[int, Vec]] = {}
        self._best_buckets = BestBuckets(self._fit_score)
        self._shapes: dict[Shape, Shape] = {}
        self._picks: dict[int, tuple[dict[int, None], dict[float | None, Rank]]] = {}
        self.nofit = NoFit()
        """Jobs known not to fit now (`scheduler.nofit`)."""
        self._group_all()

    def _group_all(self) -> None:
        index: dict[tuple[str, frozenset[str]], Group] = {}
        for slot in self.slots:
            state = slot.state
            key = self.memo.caps_key(state.caps, exact=self._exact)
            group = index.get((key, state.queues))
            if group is None:
                group = Group(len(self.groups), state.caps, key, state.queues)
                index[(key, state.queues)] = group
                self.groups.append(group)
            slot.group = group.idx
            if not state.available:
                group.away.append(slot.idx)
                continue
            group.members.append(slot.idx)
            if not slot.closed:
                group.buckets.setdefault(slot.shape(), {})[slot.idx] = None

    def eligible(self, job: PendingJob) -> tuple[Group, ...]:
        """Groups that consume the job's queue and could ever run its class."""
        key = (job.class_key, job.queue)
        hit = self._eligible.get(key)
        if hit is None:
            hit = self._eligible[key] = tuple(
                g
                for g in self.groups
                if job.queue in g.queues
                and self.memo.ever(job, g.caps_key, g.caps).verdict is not Verdict.NEVER
            )
        return hit

    def free_of(self, shape: Shape) -> FreeCapacity:
        """The matching view of a shape (labels restored from their keys)."""
        hit = self._frees.get(shape)
        if hit is None:
            labels = tuple(dict(k) for k in shape[1])
            hit = self._frees[shape] = to_free(shape[0], labels)
        return hit

    def verdict(self, job: PendingJob, group: Group, shape: Shape) -> MatchResult:
        """`match` of the job's class on any worker of `group` in `shape`."""
        key = (job.class_key, group.idx, shape)
        hit = self._verdicts.get(key)
        if hit is None:
            hit = self._verdicts[key] = match(
                job.req, group.caps, self.free_of(shape), locality_weight=0
            )
        return hit

    def score(self, ask: Ask, group: Group, shape: Shape) -> PlacementScore:
        """The placement score of `ask` on any worker of `group` in `shape`."""
        job = ask.job
        key = (job.class_key, ask.soft, job.gpu_affinity, group.idx, shape)
        hit = self._scores.get(key)
        if hit is None:
            running = tuple(dict(k) for k in shape[1])
            weight = self.policy.locality_weight
            soft = soft_score(
                job.req, group.caps, locality_weight=weight, running=running, hints=job.hints
            )
            milli = share_milli(job.req, group.caps)
            hit = self._scores[key] = placement(
                ask.want,
                shape[0],
                totals_of(group.caps),
                soft,
                self.workload,
                job.gpu_affinity,
                self.policy,
                devices=shape[3],
                milli=FULL if milli is None else milli,
                model=(group.caps.gpu.type or "") if group.caps.gpu else "",
            )
        return hit

    def fit_now(self, ask: Ask, spare: bool = False) -> tuple[Slot, PlacementScore] | None:
        """The best worker where the job may start now, by placement score; None if none.

        A worker with a free pool process comes first: on one whose processes are all
        busy the job would wait in the pool's queue, holding its devices. In a group of
        large workers a timed job goes where it delays the drain least (`timefit`). Ties go
        to the worker whose jobs end latest, up to the job's own end (`aligned`), then to
        one without a reservation, then to the first in the fleet (`Ties`).
        """
        if self.nofit.known(ask):
            return None
        kid = self._ask_id(ask)
        ties: Ties[RankKey, Candidate] = Ties()
        eligible = self.eligible(ask.job)
        largest = self.workload.largest
        timed = [g for g in eligible if ask.end is not None and large(g.caps.gpu_count, largest)]
        for group in timed:
            offer_in_time(ties, self._places(kid, ask, group), spare)
        for group in eligible:
            top, items = self._best_buckets.of(kid, ask, group)
            if top is not None and group not in timed:
                ties.offer_all(plain(top, spare), items)
        for group in eligible:
            for i in () if group in timed else group.reserved:
                slot = self.slots[i]
                score = None if slot.closed else self._fit_score(kid, ask, group, slot.shape())
                key = plain((slot.free[4] >= 1, 0.0 if score is None else score.total), spare)
                if score is not None and not ties.below(key) and self.may_backfill(ask, slot):
                    ties.offer(key, (group, slot.shape(), {}, score, slot))
        found = self._best_tied(ties, ask.end)
        if found is None:
            self.nofit.record(ask)
        return found

    def _best_tied(
        self, ties: Ties[RankKey, Candidate], end: float | None
    ) -> tuple[Slot, PlacementScore] | None:
        """Among candidates tied on (free process, score): the most `aligned` worker,
        then one without a reservation, then the first in the fleet. A bucket whose first
        worker is idle or outlasts the job ranks by that worker (`_pick` takes it), with
        nothing to look up."""
        best: tuple[Rank, PlacementScore] | None = None
        until = math.inf if end is None else end
        for group, shape, members, score, held in ties.items:
            if held is not None:
                rank = (aligned(held, end), not held.reserved, -held.idx)
            else:
                first = self.slots[next(iter(members))]
                drain = first.drain_at()
                if shape[2] or drain >= until:
                    rank = (min(drain, until), True, -first.idx)
                else:
                    rank = self._bucket_rank(group, shape, members, end)
            if best is None or rank > best[0]:
                best = (rank, score)
        return None if best is None else (self.slots[-best[0][2]], best[1])

    def _places(self, kid: int, ask: Ask, group: Group) -> list[tuple[Key, int, Candidate]]:
        """Where in `group` a timed job may start now, each with its `delay_steps` (`_pick`)."""
        end = math.inf if ask.end is None else ask.end
        out: list[tuple[Key, int, Candidate]] = []
        for shape, members in group.buckets.items():
            if (score := self._fit_score(kid, ask, group, shape)) is not None:
                late = late_on(ask, self.policy, self._pick(group, shape, members, end), self.now)
                out.append(
                    ((shape[0][4] >= 1, score.total), late, (group, shape, members, score, None))
                )
        for i in group.reserved:
            slot = self.slots[i]
            score = None if slot.closed else self._fit_score(kid, ask, group, slot.shape())
            if score is not None and self.may_backfill(ask, slot):
                late, place = late_on(ask, self.policy, slot, self.now), (group, slot.shape())
                out.append(((slot.free[4] >= 1, score.total), late, (*place, {}, score, slot)))
        return out

    def _bucket_rank(
        self, group: Group, shape: Shape, members: dict[int, None], end: float | None
    ) -> Rank:
        """The rank of the bucket's `_pick` for a job ending at `end`, kept until a worker
        joins or leaves the bucket (the entry holds `members`, so its id stays unique)."""
        kept = self._picks.get(id(members))
        if kept is None or kept[0] is not members:
            kept = self._picks[id(members)] = (members, {})
        rank = kept[1].get(end)
        if rank is None:
            slot = self._pick(group, shape, members, end)
            rank = kept[1][end] = (aligned(slot, end), True, -slot.idx)
        return rank

    def _ask_id(self, ask: Ask) -> int:
        """A small number for what `fits` and `score` read of a job, so the per-bucket
        cache hashes ints rather than the job's requirements."""
        job, req = ask.job, ask.job.req
        share, link = gpu_share(req), wants_link(req)
        key = (job.class_key, ask.want, ask.dedicated, ask.soft, job.gpu_affinity, share, link)
        return self._ask_ids.setdefault(key, len(self._ask_ids))

    def _fit_score(self, kid: int, ask: Ask, group: Group, shape: Shape) -> PlacementScore | None:
        """The score of the job on `group`'s workers in `shape` if it fits there, else None
        (kept by job and shape; the entry holds the shape, so its id is not reused)."""
        key = (kid, group.idx, id(shape))
        hit = self._fit_scores.get(key)
        if hit is not None and hit[0] is shape:
            return hit[1]
        score = self.score(ask, group, shape) if self.fits(ask, group, shape) else None
        self._fit_scores[key] = (shape, score)
        return score

    def _pick(
        self, group: Group, shape: Shape, members: dict[int, None], end: float | None
    ) -> Slot:
        """The bucket's worker with the highest `aligned`, the first on a tie."""
        first, until = self.slots[next(iter(members))], math.inf if end is None else end
        if shape[2] or first.drain_at() >= until:  # idle, or outlasts the job: none better
            return first
        drains = group.drains.get(shape)
        if drains is None:
            drains = Drains((i, self.slots[i].drain_at()) for i in members)
            group.drains[shape] = drains
        return self.slots[drains.pick(until)]

    def fits(self, ask: Ask, group: Group, shape: Shape) -> bool:
        """Whether `ask` fits any worker of `group` in `shape` now (backfill aside)."""
        if not covers(shape[0], ask.want) or (ask.dedicated and not shape[2]):
            return False
        if shape[4] is not None and wants_link(ask.job.req) and ask.want[0] > shape[4]:
            return False  # not that many free devices are NVLink peers of each other now
        if gpu_share(ask.job.req) is not None and not share_fits(ask.job.req, group.caps, shape[3]):
            return False
        return self.verdict(ask.job, group, shape).verdict is Verdict.FITS

    def may_backfill(self, ask: Ask, slot: Slot) -> bool:
        """Whether starting now leaves every firm hold on `slot` its capacity (see backfill)."""
        return covers(self.lowest(slot, ask.end), self.taken(ask, slot))

    def lowest(self, slot: Slot, end: float | None) -> Vec:
        """The least free on `slot` from now to `end` (its timeline's, kept per version)."""
        key = (slot.idx, end)
        hit = self._lowest.get(key)
        if hit is not None and hit[0] == slot.version:
            return hit[1]
        low = slot.timeline().lowest_between(self.now, end)
        self._lowest[key] = (slot.version, low)
        return low

    def taken(self, ask: Ask, slot: Slot) -> Vec:
        """What the job takes on `slot` now (`candidates.taken_on`)."""
        return taken_on(ask, slot, self.groups[slot.group].caps)

    def need(self, ask: Ask, slot: Slot) -> Vec:
        """What the job needs of `slot` in all: its footprint, or the whole worker."""
        return finite(slot.capacity) if ask.dedicated else ask.want

    def assign(self, ask: Ask, slot: Slot) -> None:
        """Start the job on `slot` now and re-bucket the slot."""
        self._unbucket(slot)
        taken = self.taken(ask, slot)
        milli = share_milli(ask.job.req, self.groups[slot.group].caps)
        slot.take_devices(int(taken[0]) if milli is None else 0, milli)
        slot.take(taken, ask.end, ask.job.labels, whole=ask.dedicated, yields=ask.yields_drain)
        self._rebucket(slot)

    def claim(self, ask: Ask, slot: Slot, freed: Vec) -> bool:
        """Give a preempting job what its victims free plus the free capacity it still lacks.

        The free part is taken now, so no job behind it can take it meanwhile;
        the victims' part is a `preempt` hold from when they are gone (the grace
        period) to the job's end. On a reserved worker the claim must leave the
        reservation whole, like backfill. False (and nothing done) when the job
        would not fit or would break a reservation.
        """
        want = self.need(ask, slot)
        if gpu_share(ask.job.req) is not None or not covers(plus(slot.free, freed), want):
            return False  # a share never preempts: it waits for milli-GPU to free
        share = lowest(slot.free, clip(minus(want, freed)))
        start = self.now + self.policy.preemption_grace_s
        limit = ask.job.time_limit_s
        end = None if limit is None else start + limit
        if slot.reserved:
            tl = slot.timeline()
            if not (
                covers(tl.lowest_between(self.now, start), share)
                and covers(tl.lowest_between(start, end), want)
            ):
                return False
        self._unbucket(slot)
        slot.take(share, end, ask.job.labels, whole=ask.dedicated, yields=ask.yields_drain)
        slot.hold(Hold(ask.job.task_id, ask.order, start, end, minus(want, share), "preempt"))
        self._rebucket(slot)
        return True

    def preempt(self, slot: Slot, victims: list[RunningJob]) -> None:
        """Count `victims` on `slot` as gone after their grace period (its drain time moves)."""
        self.nofit.forget()
        self._unbucket(slot)
        slot.preempt(victims)
        self._rebucket(slot)

    def hold(self, slot: Slot, hold: Hold) -> None:
        """Put a hold on `slot`; a firm one takes it out of its shape bucket."""
        self._unbucket(slot)
        slot.hold(hold)
        self._rebucket(slot)

    def _unbucket(self, slot: Slot) -> None:
        group = self.groups[slot.group]
        if slot.idx in group.reserved or not slot.state.available or slot.closed:
            return
        shape = slot.shape()
        members = group.buckets[shape]
        del members[slot.idx]
        self._picks.pop(id(members), None)
        drains = group.drains.get(shape)
        if drains is not None:
            drains.remove(slot.idx)
        if not members:
            del group.buckets[shape]
            group.changes.append((shape, None))
            group.drains.pop(shape, None)

    def _rebucket(self, slot: Slot) -> None:
        group = self.groups[slot.group]
        if not slot.state.available or slot.closed:
            return
        if slot.reserved:
            group.reserved[slot.idx] = None
        else:
            shape = slot.shape()
            members = group.buckets.get(shape)
            if members is None:  # a shape seen before keeps its object, so its fit checks
                shape = self._shapes.setdefault(shape, shape)  # stay kept (`_fit_score`)
                members = group.buckets[shape] = {}
                group.changes.append((shape, members))
            members[slot.idx] = None
            self._picks.pop(id(members), None)
            drains = group.drains.get(shape)
            if drains is not None:
                drains.add(slot.idx, slot.drain_at())
