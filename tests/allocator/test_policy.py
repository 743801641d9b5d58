"""Tests for `celery_ojs_ml.allocator.policy`: the backfill rule and victim choice.

Backfill: held requests are served in strict priority order; a request behind
a waiting one starts only inside what is left after setting aside the whole
demand of every waiting request ahead of it (DESIGN invariant 4).
Victims: lowest band first, newest first, then pruned to a minimal set; a job
whose `ext_mlx_scheduling_preemption_policy` is `never`, or that was preempted
`ojs_ml_max_preemptions` times, is not a victim at all.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.allocator import Allocation, Allocator, with_preemption_limits
from celery_ojs_ml.matching import FreeCapacity
from tests.allocator.helpers import FakeClock, allocator, hold, job, run, waiting


def _with_reserved_waiting_for_two_gpus(**head: Any) -> Allocator:
    """3 of 4 GPUs busy with spot work; a reserved job waits for 2 GPUs (+ `head`)."""
    clock = FakeClock()
    a = allocator(clock=clock)
    run(a, "spot-run", job(gpu_count=3, priority_class="spot"))
    hold(a, "res", job(gpu_count=2, priority_class="reserved", **head))
    clock.advance(1)
    return a


def test_a_lower_band_job_does_not_take_the_gpu_a_waiting_reserved_job_needs() -> None:
    a = _with_reserved_waiting_for_two_gpus()
    pending = waiting(a.try_alloc("spot", "spot", job(gpu_count=1, priority_class="spot")))
    assert pending.reason == "behind held res (reserved) waiting for gpu_count"


def test_a_same_band_later_job_does_not_overtake_the_head_of_the_queue() -> None:
    a = _with_reserved_waiting_for_two_gpus()
    pending = waiting(a.try_alloc("r2", "r2", job(gpu_count=1, priority_class="reserved")))
    assert pending.reason == "behind held res (reserved) waiting for gpu_count"


def test_a_cpu_only_job_backfills_past_a_job_waiting_for_gpus() -> None:
    a = _with_reserved_waiting_for_two_gpus()
    assert run(a, "cpu", job(cpu_cores=4, priority_class="spot")).devices == ()


def test_backfill_may_not_take_cpu_cores_the_waiting_job_also_needs() -> None:
    a = _with_reserved_waiting_for_two_gpus(cpu_cores=20)
    pending = waiting(a.try_alloc("cpu", "cpu", job(cpu_cores=16)))
    assert pending.reason == "behind held res (reserved) waiting for cpu_cores"
    assert isinstance(a.try_alloc("small", "small", job(cpu_cores=12)), Allocation)


def test_a_higher_band_request_is_not_blocked_by_lower_band_held_requests() -> None:
    clock = FakeClock()
    a = allocator(clock=clock)
    run(a, "busy", job(gpu_count=3))
    hold(a, "spot", job(gpu_count=2, priority_class="spot"))
    clock.advance(1)
    assert run(a, "res", job(gpu_count=1, priority_class="reserved")).devices == (3,)


def test_pump_backfills_only_jobs_that_leave_the_head_its_resources() -> None:
    clock = FakeClock()
    a = allocator(clock=clock)
    run(a, "busy", job(gpu_count=4, cpu_cores=8))
    hold(a, "res", job(gpu_count=4, priority_class="reserved"))
    clock.advance(1)
    hold(a, "gpu", job(gpu_count=1, priority_class="spot"))
    clock.advance(1)
    hold(a, "cpu", job(cpu_cores=30, priority_class="spot"))
    assert a.pump() == []  # cpu_cores free 24 < 30
    a.free("busy")
    assert [x.task_id for x in a.pump()] == ["res", "cpu"]
    assert [p.task_id for p in a.held()] == ["gpu"]


def test_a_blocked_request_explains_which_held_request_it_waits_behind() -> None:
    clock = FakeClock()
    a = allocator(clock=clock)
    run(a, "busy", job(gpu_count=2))
    hold(a, "big", job(gpu_count=4))
    clock.advance(1)
    small = hold(a, "small", job(gpu_count=1))
    assert a.pump() == []
    assert small.reason == "behind held big (on-demand) waiting for gpu_count"


def _running(a: Allocator, clock: FakeClock, jobs: list[tuple[str, dict[str, Any]]]) -> None:
    for task_id, attrs in jobs:
        clock.advance(1)
        run(a, task_id, job(**attrs))


SPOT = {"priority_class": "spot"}
OD_PREEMPTIBLE = {"priority_class": "on-demand", "preemptible": True}


@pytest.mark.parametrize(
    ("jobs", "req", "band", "allow_on_demand", "victims"),
    [
        pytest.param(
            [("s1", {"gpu_count": 2, **SPOT}), ("s2", {"gpu_count": 2, **SPOT})],
            {"gpu_count": 2},
            "on-demand",
            False,
            ["s2"],
            id="the most recently started spot job goes first (least work lost)",
        ),
        pytest.param(
            [("s", {"gpu_count": 2, **SPOT}), ("od", {"gpu_count": 2, **OD_PREEMPTIBLE})],
            {"gpu_count": 2},
            "reserved",
            True,
            ["s"],
            id="the lowest band goes first even when a higher one started later",
        ),
        pytest.param(
            [("old", {"gpu_count": 2, **SPOT}), ("new", {"gpu_count": 1, **SPOT})],
            {"gpu_count": 3},
            "on-demand",
            False,
            ["old"],
            id="a victim the others make redundant is spared (fewest victims)",
        ),
        pytest.param(
            [("s", {"gpu_count": 1, **SPOT})],
            {"gpu_count": 2},
            "on-demand",
            False,
            [],
            id="a request that fits now needs no victims",
        ),
        pytest.param(
            [("od", {"gpu_count": 4, **OD_PREEMPTIBLE})],
            {"gpu_count": 1},
            "reserved",
            False,
            None,
            id="on-demand jobs are not victims unless the worker allows it",
        ),
        pytest.param(
            [("od", {"gpu_count": 4, **OD_PREEMPTIBLE})],
            {"gpu_count": 1},
            "reserved",
            True,
            ["od"],
            id="with the flag on-demand jobs are victims of reserved requests",
        ),
        pytest.param(
            [("od", {"gpu_count": 4, **OD_PREEMPTIBLE})],
            {"gpu_count": 1},
            "on-demand",
            True,
            None,
            id="a job is never a victim of its own band",
        ),
        pytest.param(
            [("od", {"gpu_count": 4, "priority_class": "on-demand"})],
            {"gpu_count": 1},
            "reserved",
            True,
            None,
            id="a job that is not preemptible is never a victim",
        ),
        pytest.param(
            [("s", {"gpu_count": 4, "priority_class": "spot", "preemptible": False})],
            {"gpu_count": 1},
            "reserved",
            False,
            None,
            id="a spot job that opted out of preemption is never a victim",
        ),
        pytest.param(
            [("s", {"gpu_count": 4, **SPOT})],
            {"gpu_count": 8},
            "reserved",
            False,
            None,
            id="a request that can never run here has no victims",
        ),
    ],
)
def test_victims_follow_the_policy(
    jobs: list[tuple[str, dict[str, Any]]],
    req: dict[str, Any],
    band: str,
    allow_on_demand: bool,
    victims: list[str] | None,
) -> None:
    clock = FakeClock()
    a = allocator(clock=clock, allow_on_demand_preemption=allow_on_demand)
    _running(a, clock, jobs)
    chosen = a.victims(job(**req), band)
    assert (None if chosen is None else [v.task_id for v in chosen]) == victims


def test_victims_also_clear_a_running_job_that_blocks_by_anti_affinity() -> None:
    clock = FakeClock()
    a = allocator(clock=clock)
    run(a, "train", job(gpu_count=1, priority_class="spot"), labels={"job_type": "train"})
    run(a, "other", job(gpu_count=1, priority_class="spot"))
    rule = {"required": [{"key": "job_type", "operator": "In", "values": ["train"]}]}
    chosen = a.victims(job(gpu_count=1, anti_affinity=rule), "on-demand")
    assert [v.task_id for v in chosen or []] == ["train"]


@pytest.mark.parametrize(
    ("above_band", "allow_on_demand", "gpus"),
    [
        pytest.param("spot", False, 1, id="nothing ranks below spot"),
        pytest.param("on-demand", False, 2, id="on-demand may preempt spot"),
        pytest.param("reserved", False, 2, id="reserved may preempt spot only by default"),
        pytest.param("reserved", True, 3, id="reserved may also preempt on-demand when allowed"),
    ],
)
def test_preemptible_capacity_adds_what_the_band_may_preempt(
    above_band: str, allow_on_demand: bool, gpus: int
) -> None:
    clock = FakeClock()
    a = allocator(clock=clock, allow_on_demand_preemption=allow_on_demand)
    _running(
        a,
        clock,
        [
            ("spot", {"gpu_count": 1, "cpu_cores": 4, **SPOT}),
            ("od", {"gpu_count": 1, **OD_PREEMPTIBLE}),
            ("fixed", {"gpu_count": 1}),
        ],
    )
    cap = a.preemptible_capacity(above_band)
    assert cap.gpus == gpus
    assert cap.cpu_cores == (28 if above_band == "spot" else 32)


def test_preemptible_capacity_is_free_capacity_when_nothing_is_preemptible() -> None:
    a = allocator()
    run(a, "fixed", job(gpu_count=2))
    assert (
        a.preemptible_capacity("reserved")
        == a.free_capacity()
        == FreeCapacity(gpus=2, cpu_cores=32, memory_gb=256, tpu_chips=None)
    )


@pytest.mark.parametrize(
    ("attrs", "limits", "victims"),
    [
        pytest.param(SPOT, {}, ["s"], id="a spot job without a policy is a victim"),
        pytest.param(
            SPOT,
            {"policy": "save_and_retry"},
            ["s"],
            id="save_and_retry keeps a spot job a victim",
        ),
        pytest.param(
            SPOT, {"policy": "immediate"}, ["s"], id="immediate keeps a spot job a victim"
        ),
        pytest.param(
            SPOT, {"policy": "never"}, None, id="a job whose policy is never is never a victim"
        ),
        pytest.param(
            {"priority_class": "on-demand"},
            {"policy": "immediate"},
            None,
            id="immediate does not make a job that is not preemptible a victim",
        ),
        pytest.param(
            SPOT,
            {"preemptions": 2, "max_preemptions": 3},
            ["s"],
            id="a job preempted fewer times than the cap is still a victim",
        ),
        pytest.param(
            SPOT,
            {"preemptions": 3, "max_preemptions": 3},
            None,
            id="a job preempted max_preemptions times is no longer a victim",
        ),
        pytest.param(
            SPOT,
            {"preemptions": 9, "max_preemptions": None},
            ["s"],
            id="without a cap a job stays a victim however often it was preempted",
        ),
    ],
)
def test_a_jobs_preemption_policy_and_count_decide_whether_it_is_a_victim(
    attrs: dict[str, Any], limits: dict[str, Any], victims: list[str] | None
) -> None:
    """OJS ML Extensions §7 (`ext_mlx_scheduling_preemption_policy`) and OJS ML §8.2."""
    a = allocator(allow_on_demand_preemption=True)
    run(a, "s", with_preemption_limits(job(gpu_count=4, **attrs), **limits))
    chosen = a.victims(job(gpu_count=1), "reserved")
    assert (None if chosen is None else [v.task_id for v in chosen]) == victims


def test_a_job_whose_policy_is_never_adds_nothing_to_the_capacity_others_may_preempt() -> None:
    """Else the worker would subscribe to reserved work it could only run by preempting it."""
    a = allocator()
    run(a, "never", with_preemption_limits(job(gpu_count=3, **SPOT), policy="never"))
    run(a, "spot", job(gpu_count=1, **SPOT))
    assert a.preemptible_capacity("reserved").gpus == 1
    assert [x.preemptible for x in a.allocations()] == [False, True]


def test_limits_leave_the_requirements_alone_when_nothing_applies() -> None:
    req = job(gpu_count=1, **SPOT)
    assert with_preemption_limits(req, policy="save_and_retry", preemptions=1) is req
