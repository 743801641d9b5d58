"""CPU cores and memory at the worker (OJS ML §3.4, §3.5): the CPUs the gate picks for a job
(`worker.cpu_cores`), and the pool child's affinity and address-space bound (`child.limits`)."""

from __future__ import annotations

import os
import resource
from types import SimpleNamespace
from typing import Any

import pytest
from billiard.einfo import ExceptionWithTraceback

from celery_ojs_ml.allocator import Allocation
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.child import limits
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.cpu_cores import MemoryBoundExceeded, assign_host, pick_cpus

CAPS = Capabilities.model_validate({"accelerator": "cpu", "cpu_cores": 8, "memory_gb": 32})


@pytest.mark.parametrize(
    ("count", "taken", "expected"),
    [
        (2, [], [0, 1]),
        (2, [0, 1], [2, 3]),
        (3, [1], [0, 2, 3]),
        (4, [0, 1, 2, 3], [0, 1, 2, 3]),
        (2, [0, 1, 2, 3, 0], [1, 2]),
        (9, [], [0, 1, 2, 3]),
    ],
    ids=[
        "the lowest free CPUs",
        "none of another job's",
        "around a taken one",
        "shared evenly when the worker declares more cores than it has",
        "the least used first when all are taken",
        "never more than the worker has",
    ],
)
def test_the_gate_picks_the_least_used_cpus_section_3_5(
    count: int, taken: list[int], expected: list[int]
) -> None:
    assert pick_cpus(count, [0, 1, 2, 3], taken) == expected


def _alloc(cores: float, memory: float, devices: tuple[int, ...] = ()) -> Allocation:
    return Allocation("k", "job", devices, cores, memory, 0, "on-demand", False, 0.0)


def _req(**headers: Any) -> SimpleNamespace:
    return SimpleNamespace(request_dict=dict(headers), on_failure=lambda *a, **k: a)


def test_a_job_gets_whole_cpus_for_its_cores_and_its_memory_bound_when_it_has_no_gpu() -> None:
    req = _req()
    assign_host(req, _alloc(1.5, 0.5), CAPS, {}, OJSMLSettings())
    cpus = sorted(os.sched_getaffinity(0))
    assert req.request_dict[h.CPUS] == cpus[: min(2, len(cpus))]
    assert req.request_dict[h.MEMORY_LIMIT] == 0.5


def test_a_gpu_job_gets_no_memory_bound_and_the_settings_turn_both_off() -> None:
    gpu = _req()
    assign_host(gpu, _alloc(1, 4, devices=(0,)), CAPS, {}, OJSMLSettings())
    assert h.MEMORY_LIMIT not in gpu.request_dict and h.CPUS in gpu.request_dict
    off = _req()
    settings = OJSMLSettings(pin_cpus=False, limit_memory=False)
    assign_host(off, _alloc(1, 4), CAPS, {}, settings)
    assert off.request_dict == {}


def test_a_memory_error_of_a_bounded_job_reaches_celery_as_that_jobs_failure() -> None:
    """Celery stops the whole worker on a MemoryError from a pool child."""
    req = _req()
    assign_host(req, _alloc(1, 0.25), CAPS, {}, OJSMLSettings())
    info = SimpleNamespace(exception=ExceptionWithTraceback(MemoryError(), "tb"))
    (passed,) = req.on_failure(info)
    assert isinstance(passed.exception.exc, MemoryBoundExceeded)
    assert str(passed.exception.exc).startswith("ext_ml_memory_gb 0.25 exceeded")


def test_the_child_runs_on_the_jobs_cpus_under_its_bound_and_gets_both_back() -> None:
    first = min(os.sched_getaffinity(0))
    before_cpus, before_as = os.sched_getaffinity(0), resource.getrlimit(resource.RLIMIT_AS)
    request = SimpleNamespace(id="j", **{h.PIN: True, h.CPUS: [first], h.MEMORY_LIMIT: 2})
    limits.set_limits(request)
    during_cpus, during_as = os.sched_getaffinity(0), resource.getrlimit(resource.RLIMIT_AS)
    limits.finish(SimpleNamespace(ignore_result=True), request, "SUCCESS", None)
    assert during_cpus == {first}
    now = limits.address_space()
    assert now is not None and during_as[0] <= now + 2 * limits.GIB
    assert during_as[1] == before_as[1]
    assert os.sched_getaffinity(0) == before_cpus
    assert resource.getrlimit(resource.RLIMIT_AS) == before_as


def test_the_reason_names_the_attribute_and_shows_a_fix() -> None:
    assert limits.memory_reason(0.25, 512 << 20) == (
        "ext_ml_memory_gb 0.25 exceeded: the job ran out of its memory bound (an address "
        'space of 512 MiB, RLIMIT_AS) (OJS ML §3.4); ask for more, e.g. "ext_ml_memory_gb": 0.5'
    )
