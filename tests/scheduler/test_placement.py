"""Rule 3, placement: among workers where a job fits now, the best placement score wins.

Best fit on GPUs first (keep whole workers free for big jobs), fragmentation
after FGD, then host resources; preferred affinity (§7.2) and model locality
(§11.3) weigh in; `ext_mlx_scheduling_gpu_affinity` spread/dedicated change it.
Hard constraints (§3, §7.1, queue) are never traded for score.
"""

from __future__ import annotations

from celery_ojs_ml.scheduler import PendingJob, WorkerState
from celery_ojs_ml.scheduler.fleet import FleetView
from celery_ojs_ml.scheduler.model import Policy
from celery_ojs_ml.scheduler.score import Workload
from celery_ojs_ml.testing.builders import worker_with
from tests.scheduler.helpers import NOW, decide, job, req, running, worker

LATER = {"pool": "later"}


def test_a_1_gpu_job_goes_to_the_1_gpu_worker_not_the_8_gpu_one() -> None:
    big, small = worker("w8", "nvidia-a100x8"), worker("w1", "nvidia-l4x1")
    for fleet in ([big, small], [small, big]):
        assert decide([job("one", gpu_count=1)], fleet).assigned() == {"one": "w1"}


def test_an_8_gpu_job_submitted_next_starts_at_once_on_the_idle_8_gpu_worker() -> None:
    fleet = [worker("w8", "nvidia-a100x8"), worker("w1", "nvidia-l4x1")]
    decision = decide([job("one", at=1, gpu_count=1), job("eight", at=2, gpu_count=8)], fleet)
    assert decision.assigned() == {"one": "w1", "eight": "w8"}


def test_best_fit_prefers_the_worker_left_with_fewest_free_gpus() -> None:
    fleet = [
        worker("three-free", jobs=[running("a", gpu_count=5, limit=600)]),
        worker("two-free", jobs=[running("b", gpu_count=6, limit=600)]),
    ]
    assert decide([job("two", gpu_count=2)], fleet).assigned() == {"two": "two-free"}


def test_fragmentation_keeps_a_whole_4_gpu_worker_for_the_4_gpu_jobs_that_wait() -> None:
    """FGD: 5 free GPUs on an 8-GPU worker are a fragment for 8-GPU jobs already.

    The big jobs wait for workers labelled `pool=later` (none is live yet); they
    count in the workload all the same (FGD's kinds ignore node selectors; a GPU
    model they do not accept would make every free GPU here a fragment for them).
    """
    fleet = [
        worker("x8", jobs=[running("a", gpu_count=3, limit=600)]),
        worker("y4", "nvidia-a100x4"),
    ]
    decision = decide(
        [job("one", at=1, gpu_count=1)]
        + [
            job(f"four{i}", at=2 + i, gpu_count=4, node_selector={"pool": "later"})
            for i in range(3)
        ]
        + [
            job(f"eight{i}", at=9 + i, gpu_count=8, node_selector={"pool": "later"})
            for i in range(2)
        ],
        fleet,
    )
    assert decision.assigned() == {"one": "x8"}


def test_a_cpu_job_prefers_a_cpu_worker_to_a_gpu_worker() -> None:
    fleet = [worker("gpu", "nvidia-a100x8"), worker("cpu", "cpu")]
    assert decide([job("cpu-job", cpu_cores=4)], fleet).assigned() == {"cpu-job": "cpu"}


def test_spread_prefers_the_emptiest_worker() -> None:
    fleet = [
        worker("busy", jobs=[running("a", gpu_count=6, limit=600)]),
        worker("empty"),
    ]
    packed = decide([job("p", gpu_count=1)], fleet).assigned()
    spread = decide([job("s", gpu_count=1, gpu_affinity="spread")], fleet).assigned()
    assert (packed, spread) == ({"p": "busy"}, {"s": "empty"})


def test_a_dedicated_job_takes_a_whole_idle_worker_and_nothing_else_lands_there() -> None:
    fleet = [worker("small", "nvidia-a100x2"), worker("big")]
    decision = decide(
        [job("alone", at=1, gpu_count=1, gpu_affinity="dedicated"), job("next", at=2, gpu_count=1)],
        fleet,
    )
    assert decision.assigned() == {"alone": "small", "next": "big"}


def test_a_dedicated_job_waits_for_a_worker_with_nothing_running() -> None:
    fleet = [worker("w8", jobs=[running("a", gpu_count=1, limit=300)])]
    decision = decide([job("alone", gpu_count=1, gpu_affinity="dedicated", limit=60)], fleet)
    assert decision.assigned() == {}
    assert decision.annotations["alone"].t_estimate == NOW + 1  # past its limit: overdue_s
    assert decision.annotations["alone"].reason_pending == (
        "1/1 workers eligible: 1 worker busy, dedicated"
    )


def test_a_dedicated_job_running_makes_its_worker_full() -> None:
    exclusive = running("alone", gpu_count=1, limit=600, exclusive=True)
    fleet = [worker("w8", jobs=[exclusive])]
    decision = decide([job("next", gpu_count=1)], fleet)
    assert decision.assigned() == {}
    assert decision.annotations["next"].reason_pending == (
        "1/1 workers eligible: 1 gpu_count free 0 < 1"
    )


def test_a_preferred_affinity_rule_outweighs_packing() -> None:
    fleet = [
        worker("plain", "nvidia-a100x2", jobs=[running("a", gpu_count=1, limit=600)]),
        WorkerState.of("zone-b", worker_with(gpus=8, labels={"zone": "b"})),
    ]
    prefers_b = {"preferred": [{"key": "zone", "operator": "In", "values": ["b"], "weight": 100}]}
    decision = decide([job("j", gpu_count=1, affinity=prefers_b)], fleet)
    assert decision.assigned() == {"j": "zone-b"}


def test_model_locality_prefers_the_worker_with_the_model_loaded() -> None:
    fleet = [
        WorkerState.of("cold", worker_with(gpus=1, gpu_type="nvidia-l4")),
        WorkerState.of("warm", worker_with(gpus=1, gpu_type="nvidia-l4", models=[("llama", None)])),
    ]
    decision = decide([job("infer", gpu_count=1, model_id="llama")], fleet)
    assert decision.assigned() == {"infer": "warm"}


def test_a_job_goes_only_to_a_worker_that_consumes_its_queue() -> None:
    fleet = [worker("default"), worker("gpu", queues=frozenset({"gpu"}))]
    decision = decide([job("j", gpu_count=8, queue="gpu"), job("k", gpu_count=8, at=1)], fleet)
    assert decision.assigned() == {"j": "gpu", "k": "default"}


def test_a_hard_constraint_is_never_traded_for_score() -> None:
    fleet = [worker("l4", "nvidia-l4x1"), worker("a100")]
    decision = decide([job("j", gpu_count=1, gpu_memory_gb=40)], fleet)
    assert decision.assigned() == {"j": "a100"}


def test_no_worker_is_given_more_than_it_has_free() -> None:
    fleet = [worker("w", "nvidia-a100x2")]
    decision = decide([job(f"j{i}", at=i, gpu_count=1) for i in range(5)], fleet)
    assert decision.assigned() == {"j0": "w", "j1": "w"}


def test_a_worker_that_is_away_is_never_assigned() -> None:
    fleet = [worker("away", available=False)]
    decision = decide([job("j", gpu_count=1)], fleet)
    assert decision.assigned() == {}
    assert decision.annotations["j"].reason_pending == "1/1 workers eligible: 1 worker away"


def test_workers_with_equal_capabilities_form_one_group_whatever_their_worker_id() -> None:
    fleet = [worker(f"w{i}") for i in range(50)] + [worker("l4", "nvidia-l4x1")]
    view = FleetView(fleet, NOW, Policy(), Workload())
    assert len(view.groups) == 2
    assert [len(g.buckets) for g in view.groups] == [1, 1]


def test_a_job_that_names_a_worker_id_runs_only_there() -> None:
    fleet = [worker(f"w{i}") for i in range(3)]
    decision = decide([job("pinned", gpu_count=8, node_selector={"worker_id": "w2"})], fleet)
    assert decision.assigned() == {"pinned": "w2"}


def test_the_band_is_taken_from_the_requirements_unless_given() -> None:
    spot = PendingJob("s", req(gpu_count=1, priority_class="spot"))
    escalated = PendingJob("e", req(gpu_count=1, priority_class="spot"), band="reserved")
    assert (spot.band, escalated.band) == ("spot", "reserved")


def test_a_tie_goes_to_the_worker_without_a_reservation() -> None:
    fleet = [
        worker(
            "reserved", "nvidia-a100x2", jobs=[running("r", started=NOW, limit=100, gpu_count=1)]
        ),
        worker("plain", "nvidia-a100x2", jobs=[running("s", started=NOW, limit=900, gpu_count=1)]),
    ]
    decision = decide(
        [job("big", at=1, gpu_count=2, limit=60), job("short", at=2, gpu_count=1, limit=50)], fleet
    )
    assert decision.reservations[0].worker == "reserved"
    assert decision.assigned() == {"short": "plain"}


def test_among_equal_placements_a_long_job_joins_the_worker_that_stays_busy_longest() -> None:
    """Best fit in time: the worker that drains soon stays free for a large job.

    Both workers are in the same free shape (same FGD score); the one whose
    running job ends in 20 h takes the 10 h job, in either fleet order.
    """
    soon = worker("soon", jobs=[running("a", gpu_count=4, limit=600 + 3_600)])
    late = worker("late", jobs=[running("b", gpu_count=4, limit=600 + 72_000)])
    for fleet in ([soon, late], [late, soon]):
        decision = decide([job("ten-hours", gpu_count=1, limit=36_000)], fleet)
        assert decision.assigned() == {"ten-hours": "late"}


def test_a_job_that_ends_before_every_worker_drains_keeps_the_fleet_order() -> None:
    soon = worker("soon", jobs=[running("a", gpu_count=4, limit=600 + 3_600)])
    late = worker("late", jobs=[running("b", gpu_count=4, limit=600 + 72_000)])
    for fleet in ([soon, late], [late, soon]):
        decision = decide([job("short", gpu_count=1, limit=600)], fleet)
        assert decision.assigned() == {"short": fleet[0].name}
