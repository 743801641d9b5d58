"""Drain deferral: a long job yields, for one pass, a start that would hold a large worker.

Key decision (measured on the trace replay, docs/performance.md "Trace replay, time
mode"): in a busy fleet, long one-GPU jobs take whatever GPU frees first, so over a few
hours every large worker ends up holding one of them and no large job can start for
a day, while small workers sit free. A job with a time limit whose best start now
would make a large worker drain `timefit.HOLD_STEPS` or more hours later
(`timefit.delay_steps`), on which it would leave some GPUs to others, is therefore
decided after the pass's other jobs: a job behind it that does not hold the worker so
long takes the place first. What is left then is its own, by the usual rules but one:
a free place in any group that holds no large worker's drain ranks first, before the
score (`timefit.offer_in_time`'s `spare`). So a deferral never leaves a GPU idle that
the job could use; and a job defers only until it has waited `Policy.drain_defer_s`.
"""

from __future__ import annotations

from celery_ojs_ml.scheduler.fleet import FleetView
from celery_ojs_ml.scheduler.model import PendingJob
from celery_ojs_ml.scheduler.order import Ask
from celery_ojs_ml.scheduler.slot import Slot
from celery_ojs_ml.scheduler.timefit import HOLD_STEPS, large, late_on


class Deferrals:
    """The jobs one pass deferred, in fleet order; `take` ends deferring for the pass."""

    def __init__(self, view: FleetView, now: float, wait_s: float) -> None:
        self.view, self.now, self.wait_s = view, now, wait_s
        self._jobs: list[PendingJob] | None = []

    def defers(self, ask: Ask, slot: Slot) -> bool:
        """Whether to decide `ask`'s job after the others, found to start now on `slot`;
        if so it is kept for `take`."""
        job = ask.job
        if (
            self._jobs is None
            or ask.end is None
            or self.now - job.submitted_at >= self.wait_s
            or not large(slot.state.caps.gpu_count, self.view.workload.largest)
            or ask.want[0] >= slot.capacity[0]  # it takes every GPU: it leaves no fragment
            or late_on(ask, self.view.policy, slot, self.now) < HOLD_STEPS  # or a spot job
        ):
            return False
        self._jobs.append(job)
        return True

    @property
    def second_turn(self) -> bool:
        """Whether the deferred jobs are being decided (`take` was called)."""
        return self._jobs is None

    def take(self) -> list[PendingJob]:
        """The deferred jobs, once; no job defers after this."""
        jobs, self._jobs = self._jobs or [], None
        return jobs
