"""Rule 4, preemption planned fleet-wide (§8.1, §8.2; DESIGN invariant 4).

Preempt only when the job fits nowhere now and cannot backfill; choose the
worker and victims that lose least work: lowest band first, then least
progress since the last committed checkpoint, then fewest GPUs. Never a job
younger than `min_runtime_before_preemption_s`, a non-preemptible one, or one
whose `ext_mlx_scheduling_preemption_policy` is `never`.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.scheduler import Preemption, Reservation, may_preempt
from celery_ojs_ml.scheduler.model import Policy
from tests.scheduler.helpers import NOW, decide, job, running, worker


def spot(task_id: str, **kw: Any) -> Any:
    """A preemptible spot job on 1 GPU (unless told otherwise), started 10 minutes ago."""
    kw.setdefault("gpu_count", 1)
    kw.setdefault("limit", 7200)
    return running(task_id, priority_class="spot", **kw)


def test_a_reserved_job_preempts_nothing_when_another_worker_is_free() -> None:
    fleet = [worker("full", jobs=[spot("s", gpu_count=8)]), worker("free")]
    decision = decide([job("res", gpu_count=8, priority_class="reserved")], fleet)
    assert decision.assigned() == {"res": "free"}
    assert decision.preemptions == ()


def test_it_preempts_the_spot_job_with_the_least_work_since_its_checkpoint() -> None:
    fleet = [
        worker(
            "w8",
            jobs=[
                spot("fresh-checkpoint", started=NOW - 3600, checkpoint=NOW - 30),
                spot("no-checkpoint", started=NOW - 600),
                spot("old-checkpoint", started=NOW - 3600, checkpoint=NOW - 900),
                running("od", gpu_count=5, limit=7200),
            ],
        )
    ]
    decision = decide([job("res", gpu_count=1, priority_class="reserved")], fleet)
    assert decision.preemptions == (Preemption("res", "w8", ("fresh-checkpoint",)),)
    assert decision.annotations["res"].reason_pending == (
        "1/1 workers eligible: 1 gpu_count free 0 < 1; preempting fresh-checkpoint on w8"
    )
    assert decision.annotations["res"].t_estimate == NOW + Policy().preemption_grace_s


def test_the_cheapest_plan_wins_across_the_fleet() -> None:
    fleet = [
        worker("costly", jobs=[spot("long-run", gpu_count=8, started=NOW - 7000)]),
        worker(
            "cheap", jobs=[spot("just-saved", gpu_count=8, started=NOW - 7000, checkpoint=NOW - 5)]
        ),
    ]
    decision = decide([job("res", gpu_count=4, priority_class="reserved")], fleet)
    assert decision.preemptions == (Preemption("res", "cheap", ("just-saved",)),)


def test_lowest_band_goes_first_even_when_it_has_more_work_at_risk() -> None:
    fleet = [
        worker("a", jobs=[running("od", gpu_count=8, started=NOW - 100, preemptible=True)]),
        worker("b", jobs=[spot("sp", gpu_count=8, started=NOW - 7000)]),
    ]
    decision = decide(
        [job("res", gpu_count=8, priority_class="reserved")], fleet, allow_on_demand_preemption=True
    )
    assert decision.preemptions == (Preemption("res", "b", ("sp",)),)


def test_fewest_gpus_breaks_a_tie_in_work_lost() -> None:
    fleet = [
        worker("a", jobs=[spot("two", gpu_count=2), running("od", gpu_count=6, limit=7200)]),
        worker("b", jobs=[spot("one", gpu_count=1), running("od2", gpu_count=7, limit=7200)]),
    ]
    decision = decide([job("res", gpu_count=1, priority_class="reserved")], fleet)
    assert decision.preemptions == (Preemption("res", "b", ("one",)),)


def test_the_victim_set_is_minimal() -> None:
    fleet = [
        worker(
            "w8",
            jobs=[
                spot("tiny", gpu_count=1, checkpoint=NOW - 1),
                spot("half", gpu_count=4, checkpoint=NOW - 2),
                spot("rest", gpu_count=3, checkpoint=NOW - 3),
            ],
        )
    ]
    decision = decide([job("res", gpu_count=4, priority_class="reserved")], fleet)
    assert decision.preemptions == (Preemption("res", "w8", ("half",)),)


@pytest.mark.parametrize(
    ("victim", "band", "policy", "allowed"),
    [
        (spot("s"), "reserved", Policy(), True),
        (spot("s"), "on-demand", Policy(), True),
        (spot("s"), "spot", Policy(), False),
        (spot("young", started=NOW - 59), "reserved", Policy(), False),
        (
            spot("young", started=NOW - 5),
            "reserved",
            Policy(min_runtime_before_preemption_s=0),
            True,
        ),
        (spot("s", preemptible=False), "reserved", Policy(), False),
        (spot("s", preemption_policy="never"), "reserved", Policy(), False),
        (spot("s", preempted_for="other"), "reserved", Policy(), False),
        (running("od", gpu_count=1, preemptible=True), "reserved", Policy(), False),
        (
            running("od", gpu_count=1, preemptible=True),
            "reserved",
            Policy(allow_on_demand_preemption=True),
            True,
        ),
        (
            running("od", gpu_count=1, preemptible=True),
            "on-demand",
            Policy(allow_on_demand_preemption=True),
            False,
        ),
        (running("res", gpu_count=1, priority_class="reserved"), "reserved", Policy(), False),
    ],
    ids=[
        "a reserved job may preempt spot",
        "an on-demand job may preempt spot",
        "a spot job preempts nothing",
        "a victim younger than the minimum runtime is exempt",
        "the minimum runtime is a setting",
        "a non-preemptible job is exempt",
        "preemption policy never makes a job exempt",
        "a job already being preempted is not chosen again",
        "on-demand is exempt by default",
        "a reserved job may preempt on-demand when the policy allows it",
        "an on-demand job never preempts on-demand",
        "nothing preempts a reserved job",
    ],
)
def test_who_may_be_preempted(victim: Any, band: str, policy: Policy, allowed: bool) -> None:
    assert may_preempt(victim, band, now=NOW, policy=policy) is allowed


def test_a_victim_younger_than_the_minimum_runtime_is_not_preempted_until_it_ages() -> None:
    fleet = [worker("w8", jobs=[spot("young", gpu_count=8, started=NOW - 30, limit=600)])]
    pending = [job("res", gpu_count=8, priority_class="reserved", limit=600)]
    decision = decide(pending, fleet)
    assert decision.preemptions == ()
    # It may preempt once the victim is 60 s old, then the victim has its grace period:
    # it is reserved from then, not from the victim's end (NOW + 570).
    assert decision.reservations == (Reservation("res", "w8", NOW + 30 + 30),)
    assert decision.annotations["res"].t_estimate == NOW + 30 + 30
    assert decide(pending, fleet, now=NOW + 30).preemptions == (
        Preemption("res", "w8", ("young",)),
    )


def test_a_job_that_can_start_by_backfill_preempts_nothing() -> None:
    fleet = [
        worker("w8", jobs=[spot("s", gpu_count=4), running("od", gpu_count=2, limit=100)]),
    ]
    decision = decide([job("res", gpu_count=2, priority_class="reserved")], fleet)
    assert (decision.assigned(), decision.preemptions) == ({"res": "w8"}, ())


def test_a_preemption_in_flight_is_not_planned_again_and_keeps_its_capacity() -> None:
    victim = spot("s", gpu_count=6, preempted_for="res")
    fleet = [worker("w8", jobs=[victim])]
    decision = decide(
        [
            job("res", at=1, gpu_count=8, priority_class="reserved"),
            job("other", at=2, gpu_count=1, priority_class="on-demand", limit=60),
        ],
        fleet,
    )
    assert decision.preemptions == ()
    assert decision.assigned() == {}
    assert decision.annotations["res"].reason_pending.endswith("; preempting s on w8")


def test_the_free_part_of_a_preemption_target_is_not_given_to_a_job_behind() -> None:
    fleet = [worker("w8", jobs=[spot("s", gpu_count=6)])]
    decision = decide(
        [
            job("res", at=1, gpu_count=8, priority_class="reserved"),
            job("small", at=2, gpu_count=1, priority_class="reserved", limit=10),
        ],
        fleet,
    )
    assert decision.preemptions == (Preemption("res", "w8", ("s",)),)
    assert decision.assigned() == {}


def test_preemption_can_be_turned_off() -> None:
    fleet = [worker("w8", jobs=[spot("s", gpu_count=8)])]
    decision = decide([job("res", gpu_count=8, priority_class="reserved")], fleet, preemption=False)
    assert decision.preemptions == ()
    assert decision.reservations[0].task_id == "res"
