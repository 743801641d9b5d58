"""One worker's free capacity from now on, as a step function of time.

Key decision (after Slurm's backfill): the future is known only through time
limits. A running job gives its resources back when its limit runs out (never,
when it has none); a reservation takes resources from its start to its end.
Two layers are kept: `firm` events (running jobs, assignments, reservations)
bound what backfill may take, and `shadow` events (start estimates of jobs
further back in order) only shape later estimates, so an estimate never
blocks a job that could start now (EASY backfill). A start is feasible when
the job's footprint stays free for its whole time limit, so a short job may
fit a gap before a later reservation; with no time limit it must stay free for
ever.
"""

from __future__ import annotations

import math
from bisect import bisect_right

from celery_ojs_ml.scheduler.vectors import INF, Vec, covers, lowest, neg, plus

Event = tuple[float, Vec]


class Timeline:
    """Levels of free capacity at `now` and at every later event time."""

    __slots__ = ("_cache", "_firm", "_shadow", "base", "now")

    def __init__(self, now: float, base: Vec) -> None:
        self.now = now
        self.base = base
        self._firm: list[Event] = []
        self._shadow: list[Event] = []
        self._cache: dict[bool, tuple[list[float], list[Vec], list[Vec]]] = {}

    def add(self, at: float, delta: Vec, *, shadow: bool = False) -> None:
        """Change the level by `delta` from time `at` on (at or before now: from now)."""
        (self._shadow if shadow else self._firm).append((max(at, self.now), delta))
        self._cache.clear()

    def hold(self, start: float, end: float | None, amount: Vec, *, shadow: bool = False) -> None:
        """Take `amount` from `start` until `end` (None: for ever)."""
        self.add(start, neg(amount), shadow=shadow)
        if end is not None:
            self.add(end, amount, shadow=shadow)

    def lowest_between(self, start: float, end: float | None) -> Vec:
        """The least firm level in effect at any time in [start, end)."""
        times, levels, _ = self._points(False)
        i = max(bisect_right(times, start) - 1, 0)
        low = levels[i]
        stop = INF if end is None else end
        for t, level in zip(times[i + 1 :], levels[i + 1 :], strict=True):
            if t >= stop:
                break
            low = lowest(low, level)
        return low

    def earliest(self, want: Vec, length: float | None = None, *, shadow: bool = True) -> float:
        """The first time from which `want` stays free for `length` s (None: for ever; inf: never).

        With `shadow`, start estimates of jobs ahead count as taken.
        """
        times, levels, suffix = self._points(shadow)
        if length is None:
            return self._for_ever(times, suffix, want)
        for i, (t, level) in enumerate(zip(times, levels, strict=True)):
            if covers(level, want) and self._holds_from(i, t + length, want, shadow):
                return t
        return math.inf

    def first_fit(self, want: Vec, *, shadow: bool = True) -> float:
        """The first time `want` is free at all: a lower bound of every `earliest`."""
        times, levels, _ = self._points(shadow)
        for t, level in zip(times, levels, strict=True):
            if covers(level, want):
                return t
        return math.inf

    def _holds_from(self, i: int, stop: float, want: Vec, shadow: bool) -> bool:
        times, levels, _ = self._points(shadow)
        for j in range(i + 1, len(times)):
            if times[j] >= stop:
                return True
            if not covers(levels[j], want):
                return False
        return True

    @staticmethod
    def _for_ever(times: list[float], suffix: list[Vec], want: Vec) -> float:
        if not covers(suffix[-1], want):
            return math.inf
        lo, hi = 0, len(times) - 1
        while lo < hi:  # suffix minima only grow with time: the first covering one
            mid = (lo + hi) // 2
            if covers(suffix[mid], want):
                hi = mid
            else:
                lo = mid + 1
        return times[lo]

    def _points(self, shadow: bool) -> tuple[list[float], list[Vec], list[Vec]]:
        """Event times (the first is now), the level from each, and suffix minima."""
        hit = self._cache.get(shadow)
        if hit is not None:
            return hit
        events = sorted(self._firm + self._shadow if shadow else self._firm)
        times, levels = [self.now], [self.base]
        for at, delta in events:
            if at == times[-1]:
                levels[-1] = plus(levels[-1], delta)
            else:
                times.append(at)
                levels.append(plus(levels[-1], delta))
        suffix = list(levels)
        for i in range(len(suffix) - 2, -1, -1):
            suffix[i] = lowest(suffix[i], suffix[i + 1])
        self._cache[shadow] = (times, levels, suffix)
        return times, levels, suffix
