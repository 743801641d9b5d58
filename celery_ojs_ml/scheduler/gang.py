"""Gang placement (Flux RFC 25 `node>slot`): every rank of a multi-worker job at once, or none.

Key decisions:
- A gang takes its place in fleet order as one job: the first of its ranks in
  fleet order (its lead) stands for it, in fair order too (counting every rank's
  GPUs), and the pass decides the whole gang when it reaches the lead. Its ranks
  count against their queue's budget together (all their GPUs, one GPU job each).
- It starts when every rank fits now on a distinct eligible worker (`place_now`),
  each the best fit for its rank; on a reserved worker only if that leaves the
  reservation whole (backfill). No rank ever runs while another waits.
- Otherwise it is reserved like a large single job (Flux RFC 27 backfill,
  `start_at`): the earliest time at which distinct workers have every rank's
  footprint free for its whole time limit. Each rank holds its worker from then,
  so a job that would delay the gang is not backfilled there and one that ends
  before it is. Beyond `reservation_depth` that time is only its estimate.
- A gang with ranks missing from the pending set (one still running, being torn
  down, or sitting out a back-off) waits until every rank is back: ranks are
  placed as a set.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from celery_ojs_ml.scheduler.estimate import Estimator
from celery_ojs_ml.scheduler.fleet import FleetView
from celery_ojs_ml.scheduler.model import Annotation, PendingJob
from celery_ojs_ml.scheduler.order import Ask, in_order
from celery_ojs_ml.scheduler.slot import Slot
from celery_ojs_ml.scheduler.vectors import covers

START_TRIES = 64
"""Start times tried per gang and pass, soonest first, before it waits without one."""

Placed = list[tuple[Ask, Slot]]


@dataclass(frozen=True, slots=True)
class Gang:
    """The ranks of one gang, all in the pending set and none sitting out a back-off."""

    gid: str
    ranks: tuple[PendingJob, ...]
    """One job per rank, by rank."""
    lead: PendingJob
    """The rank first in fleet order: the gang's place in order."""

    @property
    def gpus(self) -> int:
        """GPUs of all its ranks together."""
        return sum(int(j.req.ext_ml_gpu_count or 0) for j in self.ranks)


def ready_gangs(
    jobs: Iterable[PendingJob], now: float
) -> tuple[dict[str, Gang], dict[str, Annotation]]:
    """The gangs among `jobs` with every rank ready, and why the others wait."""
    by_gang: dict[str, list[PendingJob]] = {}
    for job in in_order(jobs):
        by_gang.setdefault(str(job.gang), []).append(job)
    gangs: dict[str, Gang] = {}
    waiting: dict[str, Annotation] = {}
    for gid, ranks in by_gang.items():
        ready = [j for j in ranks if j.not_before <= now]  # backed off: waits its turn
        size = ranks[0].gang_size
        one: dict[int, PendingJob] = {}
        for job in ready:
            one.setdefault(job.rank, job)  # first in fleet order per rank
        if len(one) < size:
            why = f"{len(ready)}/{size} ranks are waiting; the rest must end first"
            waiting.update(gang_waits(gid, ready, why))
            continue
        chosen = tuple(one[r] for r in sorted(one)[:size])
        gangs[gid] = Gang(gid, chosen, min(chosen, key=lambda j: j.order))
    return gangs, waiting


def gang_waits(gid: str, ranks: Iterable[PendingJob], why: str) -> dict[str, Annotation]:
    """One reason for every rank of a waiting gang."""
    note = f"gang {gid}: {why}"
    return {j.task_id: Annotation(j.task_id, note, None, None) for j in ranks}


def place_now(view: FleetView, asks: Sequence[Ask]) -> Placed | str:
    """Each rank on its own worker now, or why not.

    Best fit per rank: a worker with a free pool process first, then the one left
    with the fewest free GPUs, then the first in the fleet."""
    used: set[int] = set()
    chosen: Placed = []
    for ask in asks:
        best: tuple[tuple[bool, float, int], Slot] | None = None
        for group in view.eligible(ask.job):
            for i in group.members:
                slot = view.slots[i]
                if i in used or slot.closed or not view.fits(ask, group, slot.shape()):
                    continue
                if slot.reserved and not view.may_backfill(ask, slot):
                    continue
                rank = (slot.free[4] < 1, slot.free[0] - ask.want[0], i)
                if best is None or rank < best[0]:
                    best = (rank, slot)
        if best is None:
            return (
                f"{len(chosen)}/{len(asks)} ranks can be placed now on distinct workers; "
                "a gang starts all ranks at once or none (Flux RFC 25 node>slot)"
            )
        used.add(best[1].idx)
        chosen.append((ask, best[1]))
    return chosen


def start_at(
    view: FleetView, estimator: Estimator, asks: Sequence[Ask]
) -> tuple[float, Placed] | None:
    """The earliest time every rank can start on a distinct worker and run its whole
    time limit, and where; None when no such time is known (see module doc).

    Candidate times are the workers' own earliest starts for a rank, soonest first:
    the gang's start is one of them, the first at which enough workers are free."""
    kinds = Counter(_alike(a) for a in asks)
    one = {_alike(a): a for a in asks}
    soonest = {k: _soonest(view, estimator, a) for k, a in one.items()}
    if any(len(soonest[k]) < n for k, n in kinds.items()):
        return None  # fewer workers could ever start such a rank than there are ranks
    first = max(soonest[k][n - 1][0] for k, n in kinds.items())
    times = sorted({t for found in soonest.values() for t, _, _ in found if t >= first})
    for t in times[:START_TRIES]:
        placed = _place_at(estimator, asks, soonest, t)
        if placed is not None:
            return t, placed
    return None


def _alike(ask: Ask) -> Hashable:
    """What a rank's possible starts depend on besides the fleet."""
    return (ask.job.class_key, ask.job.queue, ask.dedicated, ask.job.time_limit_s)


def _soonest(view: FleetView, estimator: Estimator, ask: Ask) -> list[tuple[float, int, Slot]]:
    """Every eligible worker with when the rank could start there, soonest first."""
    out = []
    for group in view.eligible(ask.job):
        for i in group.members:
            slot = view.slots[i]
            t = estimator.earliest(ask, slot)
            if t < math.inf:
                out.append((t, i, slot))
    out.sort(key=lambda x: (x[0], x[1]))
    return out


def _place_at(
    estimator: Estimator,
    asks: Sequence[Ask],
    soonest: dict[Hashable, list[tuple[float, int, Slot]]],
    start: float,
) -> Placed | None:
    """Each rank on a distinct worker where its footprint is free from `start` to its end."""
    used: set[int] = set()
    chosen: Placed = []
    for ask in asks:
        limit = ask.job.time_limit_s
        end = None if limit is None else start + limit
        for t, i, slot in soonest[_alike(ask)]:
            if t > start:
                return None
            if i in used:
                continue
            if covers(slot.timeline().lowest_between(start, end), estimator.need(ask, slot)):
                used.add(i)
                chosen.append((ask, slot))
                break
        else:
            return None
    return chosen
