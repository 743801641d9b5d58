"""A worker whose devices differ (OJS ML §3.2, §11 `gpu_devices`): a host of two GPU models
and a host with MIG devices. A job takes devices of its kind only (`allocator.device_kinds`)."""

from __future__ import annotations

import pytest

from celery_ojs_ml.allocator import Denied, Pending
from celery_ojs_ml.capabilities import Capabilities, probe
from celery_ojs_ml.testing.fake_nvml import mig_host, mixed_host
from tests.allocator.helpers import allocator, job, run
from tests.capabilities.test_probe import FakePsutil

MIXED = probe(nvml=mixed_host(), psutil_mod=FakePsutil(), runtimes=())
"""A100, A100, T4, A100 (allocation indices 0-3)."""
MIG = probe(nvml=mig_host(), psutil_mod=FakePsutil(), runtimes=())
"""MIG 3g.40gb, 1g.10gb, 1g.10gb, then a whole A100 80GB (indices 0-3)."""


def test_a_job_for_the_minority_model_gets_the_minority_device_section_3_2() -> None:
    alloc = allocator(MIXED)
    t4 = run(alloc, "t4", job(gpu_type="nvidia-t4", gpu_count=1))
    a100 = run(alloc, "a100", job(gpu_type="nvidia-a100", gpu_count=3))
    assert t4.devices == (2,)
    assert sorted(a100.devices) == [0, 1, 3]


def test_a_job_of_one_model_never_takes_the_other_models_free_device() -> None:
    alloc = allocator(MIXED)
    run(alloc, "t4", job(gpu_type="nvidia-t4", gpu_count=1))
    second = alloc.try_alloc("t4-b", "t4-b", job(gpu_type="nvidia-t4", gpu_count=1))
    assert isinstance(second, Pending)
    assert second.reason == "gpu_count free 0 of its kind < 1"


@pytest.mark.parametrize(
    ("attrs", "reason"),
    [
        ({"gpu_type": "nvidia-t4", "gpu_count": 2}, "gpu_count 1 of its kind < 2"),
        ({"gpu_type": "nvidia-h100", "gpu_count": 1}, "gpu_type nvidia-a100 not in [nvidia-h100]"),
        ({"gpu_count": 4, "gpu_memory_gb": 40}, "gpu_count 3 of its kind < 4"),
    ],
    ids=["more of the minority model than it has", "a model it lacks", "four GPUs of 40 GB"],
)
def test_a_job_its_devices_can_never_serve_is_denied_with_the_reason(
    attrs: dict[str, object], reason: str
) -> None:
    found = allocator(MIXED).try_alloc("x", "x", job(**attrs))
    assert isinstance(found, Denied)
    assert reason in found.reason


def test_a_one_gpu_job_gets_the_smallest_mig_device_that_holds_it() -> None:
    """Best fit over the devices of its kind: a 10 GB job takes a 1g.10gb slice."""
    alloc = allocator(MIG)
    small = run(alloc, "small", job(gpu_type="nvidia-a100", gpu_memory_gb=10))
    mid = run(alloc, "mid", job(gpu_type="nvidia-a100", gpu_memory_gb=40))
    assert small.devices == (1,)
    assert mid.devices == (0,)  # the 3g.40gb slice, not the whole 80 GB A100


def test_a_multi_gpu_job_never_gets_a_mig_device() -> None:
    """CUDA gives a process one MIG device: the host has one A100 for a 2-GPU job."""
    found = allocator(MIG).try_alloc("two", "two", job(gpu_type="nvidia-a100", gpu_count=2))
    assert isinstance(found, Denied)
    assert found.reason == "gpu_count 1 of its kind < 2"


def test_a_warm_child_never_moves_a_job_onto_devices_of_another_kind() -> None:
    alloc = allocator(MIXED)
    run(alloc, "a100", job(gpu_type="nvidia-a100", gpu_count=1))
    assert alloc.move("a100", (2,)) is None  # the T4
    moved = alloc.move("a100", (3,))
    assert moved is not None and moved.devices == (3,)


def test_declared_per_device_facts_must_list_each_device_once() -> None:
    with pytest.raises(ValueError, match="gpu_devices"):
        Capabilities.model_validate(
            {"gpu": {"type": "nvidia-a100", "count": 2},
             "gpu_devices": [{"type": "nvidia-a100", "memory_gb": 80}]}
        )  # fmt: skip
