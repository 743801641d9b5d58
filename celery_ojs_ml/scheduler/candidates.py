"""The fleet's groups and shape buckets, what a start-now search keeps of them, and two
checks of a job's devices.

Key decision: a search for the best worker where a job may start now ranks every
candidate by (free pool process, placement score) first, and every worker of a shape
bucket shares both. `Ties` keeps only the candidates that reach the highest such pair,
so the per-worker steps (picking a bucket's worker by drain time, a reserved worker's
backfill check) run for those alone; the winner is the same as ranking them all.
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Callable
from itertools import count
from typing import Generic, TypeVar

from celery_ojs_ml.allocator.sharing import FULL, pick_share, share_milli
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.scheduler.drains import Drains
from celery_ojs_ml.scheduler.order import Ask
from celery_ojs_ml.scheduler.score import PlacementScore
from celery_ojs_ml.scheduler.slot import Shape, Slot
from celery_ojs_ml.scheduler.vectors import Vec, finite, plus
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share

T = TypeVar("T")
Key = tuple[bool, float]
"""(a pool process is free, placement score total): higher is better."""
RankKey = tuple[bool, float, int, bool, float]
"""What `Ties` ranks by, higher first: the best `Key` of the place's group, minus its delay
steps (`scheduler.timefit`; 0 where best fit in time does not apply), its own `Key`."""
K = TypeVar("K", Key, RankKey)


class Group:
    """Workers with equal capabilities and queues, bucketed by free shape."""

    __slots__ = (
        "away",
        "buckets",
        "caps",
        "caps_key",
        "changes",
        "drains",
        "idx",
        "members",
        "queues",
        "reserved",
    )

    def __init__(self, idx: int, caps: Capabilities, caps_key: str, queues: frozenset[str]):
        self.idx = idx
        self.caps = caps
        self.caps_key = caps_key
        self.queues = queues
        self.buckets: dict[Shape, dict[int, None]] = {}
        self.drains: dict[Shape, Drains] = {}  # built when a busy bucket is first searched
        self.reserved: dict[int, None] = {}
        self.away: list[int] = []
        self.members: list[int] = []  # available workers, in fleet order
        self.changes: list[tuple[Shape, dict[int, None] | None]] = []
        """Buckets opened (with their members) or closed (None) so far, in turn."""

    @property
    def shapes(self) -> int:
        """How many buckets were opened or closed so far (members aside)."""
        return len(self.changes)


Rank = tuple[float, bool, int]
"""(`aligned`, no reservation, -index): among candidates tied on score, higher wins."""
Candidate = tuple[Group, Shape, dict[int, None], PlacementScore, Slot | None]
"""A place the job may start now: a shape bucket (its members), or a reserved worker."""


class Ties(Generic[K, T]):
    """The candidates that share the highest key offered so far."""

    __slots__ = ("items", "key")

    def __init__(self) -> None:
        self.key: K | None = None
        self.items: list[T] = []

    def below(self, key: K) -> bool:
        """Whether a candidate with `key` can no longer be among the best."""
        return self.key is not None and key < self.key

    def offer(self, key: K, item: T) -> None:
        """Keep `item` when its key is the highest so far or ties it."""
        if self.key is None or key > self.key:
            self.key, self.items = key, [item]
        elif key == self.key:
            self.items.append(item)

    def offer_all(self, key: K, items: list[T]) -> None:
        """`offer` each of `items`, which share `key`."""
        if self.key is None or key > self.key:
            self.key, self.items = key, list(items)
        elif key == self.key:
            self.items += items


FitScore = Callable[[int, Ask, Group, Shape], PlacementScore | None]
"""The score of a job (its fit-search id, its ask) on a group's workers in a shape, None
where it does not fit (`FleetView._fit_score`: a bound method, held weakly)."""


class BestBuckets:
    """Each kind of job's best shape buckets in each group, kept while buckets open and close.

    A bucket ranks by its shape alone, so a kind of job ranks each bucket once: a heap
    holds every bucket it fits, best first, and a look at the buckets opened and closed
    since the last search brings the best up to date: the best of before that are still
    open, tied with or beaten by the buckets opened since, or, when every best one has
    closed, the next best on the heap. Closed buckets leave the heap when they reach its
    top; it is ranked again from the buckets open when more changed than are open."""

    __slots__ = ("_kept", "_score", "_seq")

    def __init__(self, score: FitScore) -> None:
        # Held weakly: the view that owns this passes its own bound method, and held
        # strongly it made every pass's whole view (slots, timelines, worker states) a
        # reference cycle, left to the cyclic collector (0.4 s a pass at 10,000 workers).
        self._score = weakref.WeakMethod(score)
        self._kept: dict[tuple[int, int], _Ranking] = {}
        self._seq = count()

    def of(self, kid: int, ask: Ask, group: Group) -> tuple[Key | None, list[Candidate]]:
        """The best key of `ask` (fit-search id `kid`) in `group`, and the buckets with it."""
        key = (kid, group.idx)
        kept = self._kept.get(key)
        if kept is not None and kept.seen == group.shapes:
            return kept.top, kept.items
        buckets = group.buckets
        if (
            kept is None
            or len(group.changes) - kept.seen > len(buckets)
            or len(kept.heap) > 4 * len(buckets) + 16
        ):
            kept = self._kept[key] = _Ranking()
            for shape, members in buckets.items():
                entry = self._entry(kid, ask, group, shape, members)
                if entry is not None:
                    kept.heap.append(entry)
            heapq.heapify(kept.heap)
            kept.top, kept.items = _top(kept.heap, buckets)
        else:
            self._catch_up(kept, kid, ask, group)
        kept.seen = group.shapes
        return kept.top, kept.items

    def _catch_up(self, kept: _Ranking, kid: int, ask: Ask, group: Group) -> None:
        buckets = group.buckets
        alive = [c for c in kept.items if buckets.get(c[1]) is c[2]]
        ties: Ties[Key, Candidate] = Ties()
        if alive:
            ties.key, ties.items = kept.top, alive
        for shape, members in group.changes[kept.seen :]:
            if members is not None and buckets.get(shape) is members:
                entry = self._entry(kid, ask, group, shape, members)
                if entry is not None:
                    heapq.heappush(kept.heap, entry)
                    ties.offer(entry[2], entry[3])
        if kept.items and not alive:  # every best one closed: the next best are on the heap
            kept.top, kept.items = _top(kept.heap, buckets)
        else:
            kept.top, kept.items = ties.key, ties.items

    def _entry(
        self, kid: int, ask: Ask, group: Group, shape: Shape, members: dict[int, None]
    ) -> Entry | None:
        """The bucket's heap entry if the job fits there."""
        score = self._score()(kid, ask, group, shape)  # type: ignore[misc]
        if score is None:
            return None
        free_process = shape[0][4] >= 1
        key, candidate = (free_process, score.total), (group, shape, members, score, None)
        return (not free_process, -score.total), next(self._seq), key, candidate


Entry = tuple[tuple[bool, float], int, Key, Candidate]
"""A bucket on a `BestBuckets` heap: its key negated (best first), a sequence number (no
two compare further), its key, and the candidate."""


class _Ranking:
    """One kind of job's buckets in one group: every bucket it fits, and the best now."""

    __slots__ = ("heap", "items", "seen", "top")

    def __init__(self) -> None:
        self.heap: list[Entry] = []
        self.seen = 0
        self.top: Key | None = None
        self.items: list[Candidate] = []


def _top(
    heap: list[Entry], buckets: dict[Shape, dict[int, None]]
) -> tuple[Key | None, list[Candidate]]:
    """The best key among the open buckets on `heap`, and those buckets (closed ones that
    reach the top leave it)."""
    tied: list[Entry] = []
    while heap and (not tied or heap[0][0] == tied[0][0]):
        entry = heapq.heappop(heap)
        if buckets.get(entry[3][1]) is entry[3][2]:
            tied.append(entry)
    for entry in tied:
        heapq.heappush(heap, entry)
    return (tied[0][2], [e[3] for e in tied]) if tied else (None, [])


def share_fits(req: MLRequirements, caps: Capabilities, free: tuple[int, ...] | None) -> bool:
    """Whether a share job fits a device now: sharing on (`free` reported), its milli-GPU
    known there (a VRAM share needs `gpu.memory_gb`) and some device with that much left."""
    milli = share_milli(req, caps)
    return free is not None and milli is not None and pick_share(free, milli) is not None


def wants_link(req: MLRequirements) -> bool:
    """Whether the job's GPUs must be NVLink peers of each other (§3.2 `nvlink`, 2+ GPUs)."""
    return (
        req.ext_ml_gpu_interconnect == "nvlink"
        and (req.ext_ml_gpu_count or 0) > 1
        and gpu_share(req) is None
    )


def taken_on(ask: Ask, slot: Slot, caps: Capabilities) -> Vec:
    """What the job takes on `slot` now: its footprint, or all that is free for `dedicated`.

    A share that would open an untouched device takes that GPU from whole jobs.
    """
    if ask.dedicated:
        return finite(slot.free)
    milli = share_milli(ask.job.req, caps)
    if milli is not None and slot.gpu_free is not None:
        device = pick_share(slot.gpu_free, milli)
        if device is not None and slot.gpu_free[device] >= FULL:
            return plus(ask.want, (1.0, 0.0, 0.0, 0.0, 0.0))
    return ask.want
