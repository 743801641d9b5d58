"""Rule 1, order: band (reserved > on-demand > spot), then Celery priority, then submit time.

The order is fleet-wide: with one free GPU anywhere, the job first in order
takes it, whichever worker it is on and whichever job was submitted first.
"""

from __future__ import annotations

import pytest

from celery_ojs_ml.scheduler import PendingJob, WorkerState, in_order, order_key
from tests.scheduler.helpers import decide, job, running, worker


def _one_free_gpu_fleet() -> list[WorkerState]:
    """Two 8-GPU workers, 15 GPUs busy with on-demand work: one GPU free, on w2."""
    return [
        worker("w1", jobs=[running("busy1", gpu_count=8, limit=3600)]),
        worker("w2", jobs=[running("busy2", gpu_count=7, limit=3600)]),
    ]


@pytest.mark.parametrize(
    ("pending", "winner"),
    [
        (
            [
                job("spot", at=1, gpu_count=1, priority_class="spot"),
                job("res", at=3, gpu_count=1, priority_class="reserved"),
            ],
            "res",
        ),
        (
            [
                job("od", at=1, gpu_count=1, priority_class="on-demand"),
                job("res", at=3, gpu_count=1, priority_class="reserved"),
            ],
            "res",
        ),
        (
            [
                job("spot", at=1, gpu_count=1, priority_class="spot"),
                job("od", at=2, gpu_count=1),
            ],
            "od",
        ),
        (
            [job("low", at=1, priority=1, gpu_count=1), job("high", at=2, priority=5, gpu_count=1)],
            "high",
        ),
        ([job("second", at=2, gpu_count=1), job("first", at=1, gpu_count=1)], "first"),
    ],
    ids=[
        "a reserved job beats an earlier spot job",
        "a reserved job beats an earlier on-demand job",
        "an on-demand job beats an earlier spot job",
        "within a band the higher Celery priority goes first",
        "within a band and priority the earlier submission goes first",
    ],
)
def test_the_one_free_gpu_of_the_fleet_goes_to_the_job_first_in_order(
    pending: list[PendingJob], winner: str
) -> None:
    decision = decide(pending, _one_free_gpu_fleet())
    assert decision.assigned() == {winner: "w2"}


def test_order_key_ranks_band_then_priority_then_submit_time_then_task_id() -> None:
    jobs = [
        job("c", at=5, priority_class="spot"),
        job("b", at=9, priority=3),
        job("a", at=9, priority=3),
        job("d", at=1, priority=9),
        job("e", at=7, priority_class="reserved"),
    ]
    assert [j.task_id for j in in_order(jobs)] == ["e", "d", "a", "b", "c"]
    assert order_key(jobs[4]) < order_key(jobs[3])


def test_a_lower_ordered_job_that_fits_elsewhere_still_starts() -> None:
    fleet = [
        worker("w8", jobs=[running("busy", gpu_count=6, limit=3600)]),
        worker("l4", "nvidia-l4x1"),
    ]
    decision = decide(
        [
            job("res", at=2, gpu_count=4, gpu_type="nvidia-a100", priority_class="reserved"),
            job("spot", at=1, gpu_count=1, gpu_type="nvidia-l4", priority_class="spot"),
        ],
        fleet,
    )
    assert decision.assigned() == {"spot": "l4"}
    assert decision.annotations["res"].worker == "w8"


def test_a_spot_job_does_not_take_the_capacity_reserved_for_a_waiting_reserved_job() -> None:
    fleet = [worker("w8", jobs=[running("busy", gpu_count=6, limit=900)])]
    decision = decide(
        [
            job("res", at=2, gpu_count=8, priority_class="reserved", limit=600),
            job("spot", at=1, gpu_count=2, priority_class="spot", limit=3600),
        ],
        fleet,
    )
    assert decision.assigned() == {}
    assert decision.annotations["spot"].reason_pending == (
        "1/1 workers eligible: 1 reserved for res"
    )
