"""Start estimates: the worker where a waiting job can start soonest, and when.

Key decision: one lazy heap per (footprint, eligible workers) holds
every eligible worker keyed by when the class's footprint stays free there for
ever after, a start that suits any time limit. A start estimate checks the
first few workers off the heap exactly for the job's own time limit (a short
job may fit a gap before a later reservation), so a decision looks at a few
workers, not all of them. A reservation, made for only the first jobs in
order, scans every eligible worker for the true soonest start.
"""

from __future__ import annotations

import heapq
import math

from celery_ojs_ml.scheduler.fleet import FleetView
from celery_ojs_ml.scheduler.order import Ask
from celery_ojs_ml.scheduler.slot import Slot
from celery_ojs_ml.scheduler.vectors import Vec

Entry = tuple[float, int, int]
"""(start from which the footprint stays free for ever, worker index, worker version)."""

HeapKey = tuple[Vec | None, tuple[int, ...]]
"""A heap's footprint (None: the whole worker, a dedicated job) and eligible groups."""

SCAN_LIMIT = 8
"""Workers, soonest first by the heap's key, checked exactly per start estimate."""


class Estimator:
    """Earliest-start queries over the fleet for one pass (see module doc).

    Within a pass, assignments and holds only take capacity away, so keys only grow:
    an entry whose worker has changed since it was pushed is a lower bound of its new
    key, recomputed when it reaches the top (lazy deletion, as in Dijkstra). A
    preemption gives capacity back, so that worker gets a fresh entry in every heap
    (`refresh`).
    """

    def __init__(self, view: FleetView) -> None:
        self.view = view
        self._shared: dict[tuple[str, str, bool], HeapKey] = {}
        self._heaps: dict[HeapKey, list[Entry]] = {}
        self._asks: dict[HeapKey, tuple[Ask, frozenset[int]]] = {}
        self._keys: dict[tuple[int, Vec], tuple[int, float]] = {}

    def need(self, ask: Ask, slot: Slot) -> Vec:
        """What the job needs free on `slot`: its footprint, or the whole worker."""
        return self.view.need(ask, slot)

    def earliest(self, ask: Ask, slot: Slot) -> float:
        """When the job could start on `slot` and run its whole time limit (inf: unknown)."""
        return slot.timeline().earliest(self.need(ask, slot), ask.job.time_limit_s)

    def exact(self, ask: Ask, preempts: bool = True) -> tuple[float, Slot] | None:
        """The true soonest start over every eligible worker (for reservations); for a
        job that `preempts` when it can, by preemption too (`by_preemption`)."""
        best: tuple[float, int, Slot] | None = None
        for group in self.view.eligible(ask.job):
            for i in group.members:
                slot = self.view.slots[i]
                t = self.earliest(ask, slot)
                t = min(t, self.by_preemption(ask, slot)) if preempts else t
                if t < math.inf and (best is None or (t, i) < best[:2]):
                    best = (t, i, slot)
        return None if best is None else (best[0], best[2])

    def by_preemption(self, ask: Ask, slot: Slot) -> float:
        """When a job above spot could start on `slot` by preempting its preemptible spot
        jobs: from when it may preempt enough of them (`Slot.timeline`'s `preempting`),
        the grace period later (inf: never, or the job is spot). As a worker's drain
        leaves such jobs out (`Slot.drain_at`), a reservation goes where the job will
        start by preemption, not behind work it would not wait for."""
        if ask.job.band == "spot" or not self.view.policy.preemption:
            return math.inf
        grace, limit = self.view.policy.preemption_grace_s, ask.job.time_limit_s
        run = None if limit is None else limit + grace
        return slot.timeline(True).earliest(self.need(ask, slot), run) + grace

    def soonest(self, ask: Ask) -> tuple[float, Slot] | None:
        """A soon start for a start estimate, and where; None when none is known.

        The heap's first `SCAN_LIMIT` workers (by when the footprint stays
        free for ever) are checked exactly for this job's time limit, which
        may fit a gap before a later reservation; the soonest of them wins.
        """
        heap = self._heap(ask)
        slots = self.view.slots
        best: tuple[float, Slot] | None = None
        taken: list[Entry] = []
        while heap and len(taken) < SCAN_LIMIT and heap[0][0] < math.inf:
            _, idx, version = heap[0]
            slot = slots[idx]
            if version != slot.version:
                heapq.heapreplace(heap, (self._key(ask, slot), idx, slot.version))
                continue
            taken.append(heapq.heappop(heap))
            t = self.earliest(ask, slot)
            if best is None or t < best[0]:
                best = (t, slot)
        for entry in taken:
            heapq.heappush(heap, entry)
        return best

    def _heap(self, ask: Ask) -> list[Entry]:
        """The heap of the job's kind: kinds with one footprint and the same eligible
        groups share one (jobs of one class in many queues served alike, for example)."""
        kind = (ask.job.class_key, ask.job.queue, ask.dedicated)
        key = self._shared.get(kind)
        if key is None:
            groups = self.view.eligible(ask.job)
            key = (None if ask.dedicated else ask.want, tuple(g.idx for g in groups))
            self._shared[kind] = key
        heap = self._heaps.get(key)
        if heap is None:
            slots = self.view.slots
            heap = [
                (self._key(ask, slots[i]), i, slots[i].version)
                for group in self.view.eligible(ask.job)
                for i in group.members
            ]
            heapq.heapify(heap)
            self._heaps[key] = heap
            self._asks[key] = (ask, frozenset(key[1]))
        return heap

    def _key(self, ask: Ask, slot: Slot) -> float:
        """When the footprint stays free on `slot` for ever: a start any time limit can use
        (kept per worker version and footprint: kinds of job with equal needs share it)."""
        need = self.need(ask, slot)
        key = (slot.idx, need)
        hit = self._keys.get(key)
        if hit is not None and hit[0] == slot.version:
            return hit[1]
        start = slot.timeline().earliest(need)
        self._keys[key] = (slot.version, start)
        return start

    def drain_target(self, ask: Ask) -> Slot | None:
        """With no known start anywhere: the eligible worker that lacks least now."""
        best: tuple[tuple[float, float, int], Slot] | None = None
        for group in self.view.eligible(ask.job):
            for i in group.members:
                slot = self.view.slots[i]
                if slot.closed:
                    continue
                need = self.need(ask, slot)
                short = [max(w - f, 0.0) for w, f in zip(need, slot.free, strict=True)]
                rank = (short[0], sum(short[1:]), i)
                if best is None or rank < best[0]:
                    best = (rank, slot)
        return None if best is None else best[1]

    def refresh(self, slot: Slot) -> None:
        """`slot` got capacity back (a preemption): push its new key into every heap it is in.

        Its older entries are stale and get recomputed when they surface.
        """
        for key, heap in self._heaps.items():
            ask, groups = self._asks[key]
            if slot.group in groups:
                heapq.heappush(heap, (self._key(ask, slot), slot.idx, slot.version))
