"""Tests for `celery_ojs_ml.allocator.core`: alloc, deny, hold, free, cancel, pump.

Rows assert the exact pending and deny texts users see; they reuse matching's
reason strings, so `match`, the worker and Flower all say the same thing.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from celery_ojs_ml.allocator import Allocation, AllocatorError, Denied, Pending
from celery_ojs_ml.matching import FreeCapacity, Verdict
from celery_ojs_ml.testing.builders import worker_with
from tests.allocator.helpers import FakeClock, allocator, hold, job, run, started, waiting

FOUR_A100 = worker_with(gpus=4, gpu_type="nvidia-a100", cpu_cores=32, ram_gb=256)


@pytest.mark.parametrize(
    ("busy", "attrs", "kind", "reason"),
    [
        pytest.param({}, {"gpu_count": 2}, Allocation, "", id="a job that fits starts now"),
        pytest.param(
            {},
            {"gpu_count": 8},
            Denied,
            "gpu_count 4 < 8",
            id="8 GPUs are denied on a 4-GPU worker",
        ),
        pytest.param(
            {"gpu_count": 3},
            {"gpu_count": 2},
            Pending,
            "gpu_count free 1 < 2",
            id="2 GPUs wait while only 1 is free",
        ),
        pytest.param(
            {"memory_gb": 200},
            {"memory_gb": 100},
            Pending,
            "memory_gb free 56 < 100",
            id="host memory is counted",
        ),
        pytest.param(
            {},
            {"gpu_type": "nvidia-h100"},
            Denied,
            "gpu_type nvidia-a100 not in [nvidia-h100]",
            id="a GPU type the worker lacks is denied",
        ),
        pytest.param(
            {"gpu_count": 4},
            {"gpu_type": "nvidia-h100", "gpu_count": 8},
            Denied,
            "gpu_type nvidia-a100 not in [nvidia-h100], gpu_count 4 < 8",
            id="a deny note lists only the NEVER reasons",
        ),
    ],
)
def test_try_alloc_answers_success_annotate_or_deny(
    busy: dict[str, Any], attrs: dict[str, Any], kind: type, reason: str
) -> None:
    a = allocator()
    if busy:
        run(a, "busy", job(**busy))
    result = a.try_alloc("k", "t", job(**attrs))
    assert isinstance(result, kind)
    assert getattr(result, "reason", "") == reason


def test_a_denied_request_carries_structured_never_reasons() -> None:
    denied = allocator().try_alloc("k", "t", job(gpu_count=8))
    assert isinstance(denied, Denied)
    assert [(r.resource, r.verdict) for r in denied.reasons] == [("gpu_count", Verdict.NEVER)]


def test_reserved_host_cpu_makes_a_whole_host_request_never_fit() -> None:
    a = allocator(reserve_cpu=2, reserve_memory_gb=16)
    denied = a.try_alloc("k", "t", job(cpu_cores=32))
    assert isinstance(denied, Denied)
    assert denied.reason == "cpu_cores 30 < 32"
    assert (a.free_capacity().cpu_cores, a.free_capacity().memory_gb) == (30, 240)


def test_two_jobs_never_share_a_device() -> None:
    a = allocator()
    first = run(a, "a", job(gpu_count=2))
    second = run(a, "b", job(gpu_count=2))
    assert (first.devices, second.devices) == ((0, 1), (2, 3))
    assert isinstance(a.try_alloc("c", "c", job(gpu_count=1)), Pending)


def test_a_one_gpu_job_takes_an_isolated_device_and_leaves_a_pair_whole() -> None:
    a = allocator()
    for name in "abcd":
        run(a, name, job(gpu_count=1))
    a.free("a")
    a.free("b")
    a.free("d")
    assert run(a, "e", job(gpu_count=1)).devices == (3,)
    assert run(a, "f", job(gpu_count=2)).devices == (0, 1)


def test_a_gpu_job_that_omits_cpu_cores_counts_no_cores() -> None:
    a = allocator()
    alloc = run(a, "t", job(gpu_count=1))
    assert (alloc.cpu_cores, alloc.memory_gb) == (0, 0)
    assert a.free_capacity().cpu_cores == 32


def test_a_job_asking_for_no_gpus_gets_no_devices() -> None:
    alloc = run(allocator(), "t", job(cpu_cores=4, memory_gb=8))
    assert (alloc.devices, alloc.cpu_cores, alloc.memory_gb) == ((), 4, 8)


def test_tpu_chips_are_counted_not_pinned() -> None:
    a = allocator(worker_with(tpu={"type": "v5e", "topology": "2x4"}))
    alloc = run(a, "t", job(tpu_type="v5e", tpu_chip_count=4))
    assert (alloc.devices, alloc.tpu_chips) == ((), 4)
    assert a.free_capacity().tpu_chips == 4
    assert waiting(a.try_alloc("u", "u", job(tpu_chip_count=8))).reason == (
        "tpu_chip_count free 4 < 8"
    )


def test_a_worker_without_tpus_reports_tpu_chips_as_untracked() -> None:
    assert allocator().free_capacity() == FreeCapacity(
        gpus=4, cpu_cores=32, memory_gb=256, tpu_chips=None
    )


def test_an_allocation_records_band_preemptibility_and_start_time() -> None:
    clock = FakeClock(now=5.0)
    a = allocator(clock=clock)
    spot = run(a, "s", job(gpu_count=1, priority_class="spot"))
    plain = run(a, "p", job(gpu_count=1))
    assert (spot.band, spot.preemptible, spot.started_at) == ("spot", True, 5.0)
    assert (plain.band, plain.preemptible) == ("on-demand", False)


def test_free_returns_what_was_freed_and_is_idempotent() -> None:
    a = allocator()
    alloc = run(a, "t", job(gpu_count=2))
    assert a.free("t") == alloc
    assert a.free("t") is None
    assert a.free_capacity().gpus == 4


def test_cancel_drops_a_held_request_and_is_idempotent() -> None:
    a = allocator()
    run(a, "busy", job(gpu_count=4))
    pending = hold(a, "t", job(gpu_count=1))
    assert a.cancel("t") is pending
    assert a.cancel("t") is None
    assert a.held() == []


@pytest.mark.parametrize("state", ["running", "held"])
def test_allocating_a_key_that_is_running_or_held_is_refused(state: str) -> None:
    a = allocator()
    run(a, "busy", job(gpu_count=4))
    if state == "running":
        run(a, "k", job(cpu_cores=1))
    else:
        hold(a, "k", job(gpu_count=1))
    with pytest.raises(AllocatorError, match=f"key 'k' is already {state}"):
        a.try_alloc("k", "k", job(cpu_cores=1))


def test_holding_a_request_that_can_never_run_here_is_refused() -> None:
    a = allocator()
    never = Pending("k", "t", job(gpu_count=8), "on-demand", 0, 0.0, "")
    with pytest.raises(AllocatorError, match=r"can never run on this worker \(gpu_count 4 < 8\)"):
        a.hold(never)


def test_held_requests_are_ordered_by_band_then_priority_then_fifo() -> None:
    clock = FakeClock()
    a = allocator(clock=clock)
    run(a, "busy", job(gpu_count=4))
    for task_id, band, priority in [
        ("spot-hi", "spot", 9),
        ("od-0", "on-demand", 0),
        ("od-5", "on-demand", 5),
        ("res", "reserved", 0),
        ("od-0-later", "on-demand", 0),
    ]:
        clock.advance(1)
        hold(a, task_id, job(gpu_count=1, priority_class=band), priority=priority)
    order = [p.task_id for p in a.held()]
    assert order == ["res", "od-5", "od-0", "od-0-later", "spot-hi"]


def test_requests_held_at_the_same_instant_keep_their_hold_order() -> None:
    a = allocator()
    run(a, "busy", job(gpu_count=4))
    for name in ["b", "a", "c"]:
        hold(a, name, job(gpu_count=1))
    assert [p.task_id for p in a.held()] == ["b", "a", "c"]


def test_prioritise_reorders_the_queue_and_ignores_unknown_keys() -> None:
    clock = FakeClock()
    a = allocator(clock=clock)
    run(a, "busy", job(gpu_count=4))
    hold(a, "first", job(gpu_count=1))
    clock.advance(1)
    hold(a, "second", job(gpu_count=1))
    assert a.prioritise("second", 10) is not None
    assert a.prioritise("nobody", 10) is None
    assert [p.task_id for p in a.held()] == ["second", "first"]


def test_pump_starts_held_requests_in_queue_order_once_resources_are_freed() -> None:
    clock = FakeClock()
    a = allocator(clock=clock)
    run(a, "busy", job(gpu_count=4))
    hold(a, "spot", job(gpu_count=2, priority_class="spot"))
    clock.advance(1)
    hold(a, "od", job(gpu_count=2))
    clock.advance(1)
    hold(a, "res", job(gpu_count=2, priority_class="reserved"))
    a.free("busy")
    assert [x.task_id for x in a.pump()] == ["res", "od"]
    assert [p.task_id for p in a.held()] == ["spot"]
    assert a.pump() == []


def test_pump_annotates_requests_that_still_wait_with_a_fresh_reason() -> None:
    a = allocator()
    run(a, "x", job(gpu_count=3))
    run(a, "y", job(gpu_count=1))
    pending = hold(a, "t", job(gpu_count=2))
    assert pending.reason == "gpu_count free 0 < 2"
    a.free("y")
    assert a.pump() == []
    assert pending.reason == "gpu_count free 1 < 2"


def test_a_job_waits_while_a_running_job_matches_its_anti_affinity() -> None:
    a = allocator()
    run(a, "train", job(gpu_count=1), labels={"job_type": "train"})
    rule = {"required": [{"key": "job_type", "operator": "In", "values": ["train"]}]}
    pending = waiting(a.try_alloc("eval", "eval", job(gpu_count=1, anti_affinity=rule)))
    assert pending.reason == "anti-affinity job_type In [train] holds on a running job"
    a.hold(pending)
    a.free("train")
    assert [x.task_id for x in a.pump()] == ["eval"]


def test_expired_removes_requests_held_longer_than_the_limit() -> None:
    clock = FakeClock()
    a = allocator(clock=clock)
    run(a, "busy", job(gpu_count=4))
    hold(a, "old", job(gpu_count=1))
    clock.advance(20)
    hold(a, "new", job(gpu_count=1))
    clock.advance(15)
    assert [p.task_id for p in a.expired(30)] == ["old"]
    assert [p.task_id for p in a.held()] == ["new"]
    assert a.expired(30) == []
    clock.advance(16)
    assert [p.task_id for p in a.expired(30)] == ["new"]


def test_a_request_held_too_long_carries_the_reason_it_waits_for_now() -> None:
    clock = FakeClock()
    a = allocator(clock=clock)
    run(a, "x", job(gpu_count=2))
    pending = hold(a, "t", job(gpu_count=3))
    assert pending.reason == "gpu_count free 2 < 3"
    run(a, "y", job(gpu_count=2, priority_class="reserved"))  # no pump: the reason is stale
    clock.advance(31)
    assert [p.reason for p in a.expired(30)] == ["gpu_count free 0 < 3"]


def test_snapshot_is_json_and_shows_devices_free_counts_and_held_reasons() -> None:
    clock = FakeClock(now=7.0)
    a = allocator(clock=clock)
    run(a, "train-1", job(gpu_count=3, cpu_cores=8, memory_gb=64))
    hold(a, "train-2", job(gpu_count=2, priority_class="reserved"), priority=3)
    snap = a.snapshot()
    assert json.loads(json.dumps(snap)) == snap
    assert snap == {
        "capacity": {"gpu_count": 4, "cpu_cores": 32, "memory_gb": 256, "tpu_chip_count": 0},
        "free": {"gpu_count": 1, "cpu_cores": 24, "memory_gb": 192, "tpu_chip_count": 0},
        "devices": {"0": "train-1", "1": "train-1", "2": "train-1", "3": None},
        "allocations": [
            {
                "task_id": "train-1",
                "devices": [0, 1, 2],
                "cpu_cores": 8,
                "memory_gb": 64,
                "tpu_chips": 0,
                "band": "on-demand",
                "preemptible": False,
                "started_at": 7.0,
            }
        ],
        "held": [
            {
                "task_id": "train-2",
                "band": "reserved",
                "priority": 3,
                "since": 7.0,
                "reason": "gpu_count free 1 < 2",
            }
        ],
    }


def test_keys_may_be_any_hashable_object() -> None:
    a = allocator()
    key = object()
    alloc = started(a.try_alloc(key, "t", job(gpu_count=1)))
    assert alloc.key is key
    assert a.free(key) == alloc
