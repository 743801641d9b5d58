"""GPU sharing in the worker's allocator (docs/sharing.md): milli-GPU per device, whole jobs
only on untouched devices, and the reasons a share job waits or can never run."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_ojs_ml.allocator import Allocation, Allocator, Denied, Pending
from celery_ojs_ml.allocator.sharing import FULL
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.testing.builders import worker_with


def req(**attrs: Any) -> MLRequirements:
    return normalize(attrs).requirements


VRAM_40 = req(ojs_ml_gpu_share=True, ext_ml_gpu_memory_gb=40)  # 500 milli of 80 GB
WHOLE_1 = req(ext_ml_gpu_count=1)


def sharing_worker(gpus: int = 2) -> Allocator:
    return Allocator(worker_with(gpus=gpus, memory_gb=80), gpu_sharing=True)


def test_two_vram_shares_take_one_device_and_leave_the_other_untouched() -> None:
    a = sharing_worker()
    first, second = a.try_alloc("a", "a", VRAM_40), a.try_alloc("b", "b", VRAM_40)
    assert isinstance(first, Allocation) and isinstance(second, Allocation)
    assert first.devices == second.devices == (0,) and first.gpu_milli == 500
    assert a.gpu_free_milli() == (0, 1000)
    assert a.free_capacity().gpus == 1


def test_a_device_a_share_is_on_is_not_a_free_gpu_for_whole_jobs() -> None:
    a = sharing_worker()
    a.try_alloc("s", "s", req(ojs_ml_gpu_share=0.1))
    assert a.free_capacity().gpus == 1
    whole = a.try_alloc("w", "w", WHOLE_1)
    assert isinstance(whole, Allocation) and whole.devices == (1,)
    two = a.try_alloc("w2", "w2", req(ext_ml_gpu_count=2))
    assert isinstance(two, Pending) and two.reason == "gpu_count free 0 < 2"


def test_a_share_waits_when_no_device_has_its_milli_left() -> None:
    a = sharing_worker(gpus=1)
    a.try_alloc("a", "a", VRAM_40)
    a.try_alloc("b", "b", req(ojs_ml_gpu_share=0.3))
    out = a.try_alloc("c", "c", VRAM_40)
    assert isinstance(out, Pending)
    assert out.reason == "gpu_share free 200 < 500 milli-GPU on every device"
    a.free("a")
    assert isinstance(a.try_alloc("c2", "c2", VRAM_40), Allocation)


def test_a_worker_with_sharing_off_can_never_run_a_share_job() -> None:
    out = Allocator(worker_with(gpus=2, memory_gb=80)).try_alloc("s", "s", VRAM_40)
    assert isinstance(out, Denied)
    assert out.reason == (
        "gpu sharing off (a job with ojs_ml_gpu_share needs a worker with "
        'ojs_ml_gpu_sharing "vram")'
    )


def test_a_vram_share_can_never_run_where_gpu_memory_is_unknown_but_a_fraction_can() -> None:
    a = Allocator(worker_with(gpus=1, gpu_type=None), gpu_sharing=True)
    out = a.try_alloc("s", "s", req(ojs_ml_gpu_share=True, ext_ml_gpu_memory_gb=8))
    assert isinstance(out, Denied) and "gpu.memory_gb unknown" in out.reason
    assert isinstance(a.try_alloc("f", "f", req(ojs_ml_gpu_share=0.5)), Allocation)


def test_the_snapshot_reports_free_milli_per_device_only_with_sharing_on() -> None:
    a = sharing_worker()
    a.try_alloc("s", "s", VRAM_40)
    assert a.snapshot()["gpu_free_milli"] == [500, 1000]
    assert "gpu_free_milli" not in Allocator(worker_with(gpus=2)).snapshot()


def test_a_share_is_not_moved_to_another_device() -> None:
    a = sharing_worker()
    a.try_alloc("s", "s", VRAM_40)
    assert a.move("s", (1,)) is None


_JOBS = st.one_of(
    st.tuples(st.just("share"), st.integers(1, 80)),  # VRAM GB on an 80 GB device
    st.tuples(st.just("frac"), st.floats(0.001, 0.999)),
    st.tuples(st.just("whole"), st.integers(1, 3)),
    st.tuples(st.just("free"), st.integers(0, 40)),
)


def _req(kind: str, amount: float) -> MLRequirements:
    if kind == "share":
        return req(ojs_ml_gpu_share=True, ext_ml_gpu_memory_gb=int(amount))
    if kind == "frac":
        return req(ojs_ml_gpu_share=amount)
    return req(ext_ml_gpu_count=int(amount))


def _check(a: Allocator, gpus: int) -> None:
    shares: dict[int, int] = {}
    whole: set[int] = set()
    for alloc in a.allocations():
        if alloc.gpu_milli:
            shares[alloc.devices[0]] = shares.get(alloc.devices[0], 0) + alloc.gpu_milli
        else:
            assert not whole & set(alloc.devices), "a device held whole twice"
            whole |= set(alloc.devices)
    assert all(total <= FULL for total in shares.values()), shares
    assert not whole & set(shares), "a whole job got a device a share is on"
    assert a.free_capacity().gpus == gpus - len(whole | set(shares))


@settings(max_examples=200, deadline=None)
@given(st.lists(_JOBS, max_size=40))
def test_random_shares_and_whole_jobs_never_oversubscribe_a_device(ops: list[Any]) -> None:
    a = sharing_worker(gpus=3)
    keys: list[str] = []
    for n, (kind, amount) in enumerate(ops):
        if kind == "free":
            if keys:
                a.free(keys.pop(int(amount) % len(keys)))
        elif isinstance(a.try_alloc(f"k{n}", f"k{n}", _req(kind, amount)), Allocation):
            keys.append(f"k{n}")
        _check(a, 3)
