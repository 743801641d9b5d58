"""Drain deferral (docs/scheduling.md, "Placement score"): a job with a time limit whose
start now would make a large worker drain four hours or more later is decided after the
pass's other jobs, until it has waited `Policy.drain_defer_s`; a job behind it takes the
place first, and what is left is the deferred job's by the usual rules."""

from __future__ import annotations

from celery_ojs_ml.scheduler import PendingJob, WorkerState
from celery_ojs_ml.scheduler.timefit import DELAY_STEP_S, HOLD_STEPS
from tests.scheduler.helpers import NOW, decide, job, running, worker

HOUR = 3600.0
DAY = 24 * HOUR


def _large(drain_in: float = 600.0) -> WorkerState:
    """An 8-GPU worker with one GPU free; its seven jobs end in `drain_in` s."""
    busy = [running(f"r{i}", limit=600 + drain_in, gpu_count=1) for i in range(7)]
    return worker("w-large", "nvidia-a100x8", busy)


def _long(waited: float = 60.0) -> PendingJob:
    return job("long", at=NOW - waited, limit=DAY, gpu_count=1)


def _short() -> PendingJob:
    return job("short", at=NOW - 30, limit=HOUR / 2, gpu_count=1)


def _started(pending: list[PendingJob], fleet: list[WorkerState], **policy: float) -> list[str]:
    return [f"{a.task_id}@{a.worker}" for a in decide(pending, fleet, **policy).assignments]


def test_a_job_behind_takes_the_place_a_long_job_would_hold_a_large_worker_with() -> None:
    decision = decide([_long(), _short()], [_large()])
    assert [(a.task_id, a.worker) for a in decision.assignments] == [("short", "w-large")]
    assert "long" in decision.annotations, "the long job waits, annotated"


def test_the_place_left_free_is_the_deferred_jobs_own() -> None:
    assert _started([_long()], [_large()]) == ["long@w-large"]
    other = job("other", at=NOW - 30, limit=HOUR, gpu_count=2)  # fits no free place
    assert _started([_long(), other], [_large()]) == ["long@w-large"]


def test_a_job_that_waited_drain_defer_s_is_not_deferred_again() -> None:
    assert _started([_long(waited=HOUR), _short()], [_large()]) == ["long@w-large"]
    assert _started([_long(), _short()], [_large()], drain_defer_s=0.0) == ["long@w-large"]


def test_a_delay_under_the_threshold_or_a_small_worker_defers_nothing() -> None:
    under = (HOLD_STEPS - 1) * DELAY_STEP_S
    assert _started([_long(), _short()], [_large(drain_in=DAY - under)]) == ["long@w-large"]
    small = worker("w-small", "nvidia-a100x2", [running("s", limit=DAY, gpu_count=1)])
    full = worker("w-big", "nvidia-a100x8", [running("b", limit=DAY, gpu_count=8)])
    assert _started([_long(), _short()], [full, small]) == ["long@w-small"]


def test_a_job_that_takes_every_gpu_of_its_worker_is_not_deferred() -> None:
    """It leaves no GPUs for others to fragment: on a fleet of 1-GPU workers, or a whole
    8-GPU worker, order decides as it would without deferral."""
    ones = [worker("w1", "nvidia-l4x1")]
    assert _started([_long(), _short()], ones) == ["long@w1"]
    whole = job("whole", at=NOW - 60, limit=DAY, gpu_count=8)
    behind = job("behind", at=NOW - 30, limit=HOUR / 2, gpu_count=8)
    assert _started([whole, behind], [worker("w8", "nvidia-a100x8")]) == ["whole@w8"]


def test_at_its_second_turn_a_deferred_job_takes_a_place_that_holds_no_drain() -> None:
    """Filling the large worker's last GPU scores higher than opening a small worker, so
    the long job's first choice holds the large worker; with nothing behind it to take
    that place, its second turn goes to the small worker, which no large job drains."""
    small = worker("w-small", "nvidia-a100x2")
    assert decide([_short()], [_large(), small]).assignments[0].worker == "w-large"
    assert _started([_long()], [_large(), small]) == ["long@w-small"]
    assert _started([_long()], [_large(), small], drain_defer_s=0.0) == ["long@w-large"]


def test_deferred_jobs_keep_their_order_among_themselves() -> None:
    fleet = [_large(), worker("w-idle", "nvidia-a100x8")]
    first = job("first", at=NOW - 90, limit=DAY, gpu_count=1)
    second = job("second", at=NOW - 60, limit=DAY, gpu_count=1)
    started = _started([first, second, _short()], fleet)
    assert started[0].startswith("short@") and [s.split("@")[0] for s in started[1:]] == [
        "first",
        "second",
    ]
