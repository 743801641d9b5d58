"""RFC 27 annotate and deny: every waiting job has `reason_pending` and `t_estimate`.

The reason is matching's pending message (the words `explain`, Flower and the
`ojs-resource-waiting` event show) plus what only the fleet knows; the start
estimate is absolute epoch seconds from the reservation arithmetic, or null.
"""

from __future__ import annotations

from celery_ojs_ml.matching import match, pending_message
from tests.scheduler.helpers import NOW, caps, decide, job, running, worker


def test_the_reason_is_matchings_pending_message_over_the_whole_fleet() -> None:
    fleet = [
        worker("a100", jobs=[running("r", started=NOW, limit=300, gpu_count=6)]),
        worker("l4", "nvidia-l4x1"),
        worker("t4", "nvidia-t4x1"),
    ]
    pending = [job("big", gpu_count=4, gpu_memory_gb=40)]
    decision = decide(pending, fleet)
    expected = pending_message(match(pending[0].req, w.caps, w.free) for w in fleet)
    assert (
        decision.annotations["big"].reason_pending
        == expected
        == (
            "1/3 workers eligible: 2 gpu_count 1 < 4, 1 gpu_count free 2 < 4, "
            "1 gpu_memory_gb 16 < 40, 1 gpu_memory_gb 24 < 40"
        )
    )


def test_t_estimate_is_when_the_running_jobs_time_limits_free_the_capacity() -> None:
    fleet = [
        worker(
            "w8",
            jobs=[
                running("a", started=NOW - 100, limit=400, gpu_count=4),
                running("b", started=NOW - 100, limit=700, gpu_count=2),
            ],
        )
    ]
    decision = decide([job("six", gpu_count=6)], fleet)
    assert decision.annotations["six"].t_estimate == NOW + 300
    assert decision.annotations["six"].as_dict() == {
        "reason_pending": "1/1 workers eligible: 1 gpu_count free 2 < 6",
        "t_estimate": NOW + 300,
    }


def test_t_estimate_is_null_when_no_running_job_has_a_time_limit() -> None:
    fleet = [worker("w8", jobs=[running("open", gpu_count=8)])]
    decision = decide([job("one", gpu_count=1)], fleet)
    assert decision.annotations["one"].t_estimate is None


def test_jobs_further_back_get_later_estimates() -> None:
    fleet = [worker("w8", jobs=[running("a", started=NOW, limit=100, gpu_count=8)])]
    pending = [job(f"j{i}", at=i, gpu_count=8, limit=50) for i in range(3)]
    decision = decide(pending, fleet)
    estimates = [decision.annotations[f"j{i}"].t_estimate for i in range(3)]
    assert estimates == [NOW + 100, NOW + 150, NOW + 200]


def test_a_job_behind_a_reservation_is_told_which_job_holds_it() -> None:
    fleet = [worker("w8", jobs=[running("a", started=NOW, limit=100, gpu_count=6)])]
    decision = decide(
        [job("big", at=1, gpu_count=8, limit=60), job("small", at=2, gpu_count=1, limit=500)], fleet
    )
    assert (
        decision.annotations["small"].reason_pending == "1/1 workers eligible: 1 reserved for big"
    )
    assert decision.annotations["small"].t_estimate == NOW + 160


def test_a_job_in_a_queue_no_worker_consumes_says_so() -> None:
    decision = decide([job("j", gpu_count=1, queue="train")], [worker("w8")])
    assert decision.annotations["j"].reason_pending == (
        "0/1 workers eligible: 1 queue train not consumed"
    )


def test_an_unsatisfiable_job_waits_with_its_reason_unless_deny_is_asked() -> None:
    pending = [job("huge", gpu_count=16)]
    waiting = decide(pending, [worker("w8")])
    denied = decide(pending, [worker("w8")], deny_unsatisfiable=True)
    assert waiting.annotations["huge"].reason_pending == "0/1 workers eligible: 1 gpu_count 8 < 16"
    assert waiting.denials == ()
    assert [(d.task_id, d.note) for d in denied.denials] == [
        ("huge", "0/1 workers eligible: 1 gpu_count 8 < 16")
    ]
    assert denied.annotations == {}


def test_a_worker_that_is_briefly_away_keeps_a_job_from_being_denied() -> None:
    fleet = [worker("w8", available=False), worker("l4", "nvidia-l4x1")]
    decision = decide([job("j", gpu_count=8)], fleet, deny_unsatisfiable=True)
    assert decision.denials == ()
    assert decision.annotations["j"].reason_pending == (
        "1/2 workers eligible: 1 gpu_count 1 < 8, 1 worker away"
    )


def test_an_empty_fleet_says_there_is_no_live_worker() -> None:
    decision = decide([job("j", gpu_count=1)], [])
    assert decision.annotations["j"].reason_pending == "0/0 workers eligible: no live workers"


def test_the_estimate_follows_the_injected_clock() -> None:
    fleet = [worker("w8", jobs=[running("a", started=NOW, limit=100, gpu_count=8)])]
    later = decide([job("j", gpu_count=1)], fleet, now=NOW + 40)
    assert later.annotations["j"].t_estimate == NOW + 100
    assert caps("nvidia-a100x8").gpu_count == 8


def test_the_worked_example_of_docs_scheduling_md() -> None:
    t0 = 1_700_000_000.0
    fleet = [
        worker(
            "gpu-a",
            jobs=[
                running("train-17", started=t0 - 3000, limit=3600, gpu_count=4),
                running("train-18", started=t0 - 2400, limit=3600, gpu_count=2),
            ],
        ),
        worker("l4-1", "nvidia-l4x1"),
    ]
    pending = [
        job("big", at=t0 - 60, limit=14400, gpu_count=8, gpu_type="nvidia-a100"),
        job("eval", at=t0 - 30, limit=300, gpu_count=1, gpu_type="nvidia-a100"),
        job("sweep", at=t0 - 20, gpu_count=1, gpu_type="nvidia-a100"),
    ]
    decision = decide(pending, fleet, now=t0)
    assert decision.assigned() == {"eval": "gpu-a"}
    assert [(r.task_id, r.worker, r.start) for r in decision.reservations] == [
        ("big", "gpu-a", 1_700_001_200.0)
    ]
    big, sweep = decision.annotations["big"], decision.annotations["sweep"]
    assert big.as_dict() == {
        "reason_pending": "1/2 workers eligible: 1 gpu_count 1 < 8, 1 gpu_count free 1 < 8, "
        "1 gpu_type nvidia-l4 not in [nvidia-a100]",
        "t_estimate": 1_700_001_200.0,
    }
    assert sweep.as_dict() == {
        "reason_pending": "1/2 workers eligible: 1 gpu_type nvidia-l4 not in [nvidia-a100], "
        "1 reserved for big",
        "t_estimate": 1_700_015_600.0,
    }


def test_only_the_first_estimate_depth_jobs_after_the_reservation_get_an_estimate() -> None:
    fleet = [
        worker("w8", jobs=[running("a", started=NOW, limit=100, gpu_count=8)]),
        worker("w8b", jobs=[running("b", started=NOW, limit=900, gpu_count=7)]),
    ]
    pending = [job(f"j{i}", at=i, gpu_count=8, limit=50) for i in range(5)]
    pending.append(job("small", at=9, gpu_count=1, limit=10_000))
    every = decide(pending, fleet)
    capped = decide(pending, fleet, estimate_depth=2)
    assert [every.annotations[f"j{i}"].t_estimate for i in range(5)] == [
        NOW + 100, NOW + 150, NOW + 200, NOW + 250, NOW + 300,
    ]  # fmt: skip
    # j0 holds the reservation; j1 and j2 are the two estimated; j3, j4 are past the depth
    assert [capped.annotations[f"j{i}"].t_estimate for i in range(5)] == [
        NOW + 100, NOW + 150, NOW + 200, None, None,
    ]  # fmt: skip
    # estimates never bind backfill: what starts, and where, is the same
    assert capped.assignments == every.assignments
    assert [a.task_id for a in capped.assignments] == ["small"]
    assert capped.reservations == every.reservations
