"""Best fit in time (docs/scheduling.md, "Placement score"): on a large worker (at least
half the GPUs of the fleet's largest) a job with a time limit starts where it makes the
worker drain later by the fewest whole hours, before the placement score is compared; a
job without a limit, or one that ends before its candidates drain anyway, is placed by
the score alone."""

from __future__ import annotations

from celery_ojs_ml.scheduler import WorkerState
from celery_ojs_ml.scheduler.timefit import DELAY_STEP_S, delay_steps
from tests.scheduler.helpers import NOW, decide, job, running, worker

HOUR = 3600.0
SOON = NOW + 600  # when the short worker's jobs reach their limits


def _fleet() -> list[WorkerState]:
    """Two 8-GPU workers: best fit on GPUs prefers `w-soon` (2 left against 7)."""
    soon = [running(f"s{i}", started=NOW - 600, limit=1200, gpu_count=1) for i in range(6)]
    late = [running("l0", started=NOW - 600, limit=10 * HOUR + 600, gpu_count=1)]
    return [worker("w-soon", "nvidia-a100x8", soon), worker("w-late", "nvidia-a100x8", late)]


def _where(limit: float | None) -> str:
    decision = decide([job("j", limit=limit, gpu_count=1)], _fleet())
    return decision.assignments[0].worker


def test_a_long_job_joins_the_large_worker_busy_longest_over_a_better_score() -> None:
    assert _where(5 * HOUR) == "w-late"


def test_without_a_time_limit_the_score_decides() -> None:
    assert _where(None) == "w-soon"


def test_a_job_ending_before_both_workers_drain_is_placed_by_the_score() -> None:
    assert _where(300) == "w-soon"


def test_the_worker_about_to_drain_stays_free_for_a_large_job() -> None:
    pending = [
        job("long", at=0, limit=5 * HOUR, gpu_count=1),
        job("big", at=1, limit=HOUR, gpu_count=8),
    ]
    decision = decide(pending, _fleet())
    assert [(a.task_id, a.worker) for a in decision.assignments] == [("long", "w-late")]
    assert [(r.task_id, r.worker, r.start) for r in decision.reservations] == [
        ("big", "w-soon", SOON)
    ]


def test_the_delay_is_counted_in_whole_steps_from_the_later_of_now_and_the_drain() -> None:
    assert delay_steps(NOW + 100, NOW, NOW + 50) == 0
    assert delay_steps(NOW, NOW, NOW + 1) == 1
    assert delay_steps(NOW - 500, NOW, NOW + DELAY_STEP_S) == 1
    assert delay_steps(NOW, NOW, NOW + DELAY_STEP_S + 1) == 2
