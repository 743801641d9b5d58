"""Jobs known not to fit now, for the rest of one pass.

Within a pass free capacity only shrinks: assignments, claims and holds take it, and
nothing running ends. So a job that found no worker where it may start now tells the
rest of the pass about every later job with the same needs: same class (hard
constraints), queue, footprint and GPU affinity, and a time limit at least as long (a
longer job has less room to backfill before a reservation). The one exception is a
preemption plan, which moves its victims' ends earlier: it empties the memo.

With 100,000 waiting jobs on 10,000 busy workers most of a pass was spent proving
again, job after job, that the same shapes do not fit (`bench/scheduler.py`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from celery_ojs_ml.scheduler.order import Ask


class NoFit:
    """The shortest time limit (as an end) that did not fit, by a job's needs."""

    __slots__ = ("_ends",)

    def __init__(self) -> None:
        self._ends: dict[Hashable, float] = {}

    @staticmethod
    def _key(ask: Ask) -> Hashable:
        job = ask.job
        return (job.class_key, job.queue, ask.want, job.gpu_affinity)

    @staticmethod
    def _end(ask: Ask) -> float:
        return math.inf if ask.end is None else ask.end

    def known(self, ask: Ask) -> bool:
        """Whether a job with the same needs and no longer a limit did not fit."""
        bound = self._ends.get(self._key(ask))
        return bound is not None and self._end(ask) >= bound

    def record(self, ask: Ask) -> None:
        """`ask` fits nowhere now."""
        key, end = self._key(ask), self._end(ask)
        self._ends[key] = min(end, self._ends.get(key, math.inf))

    def forget(self) -> None:
        """Capacity may have grown (a preemption moved victims' ends): know nothing."""
        self._ends.clear()
