"""Small helpers for allocator tests: a fake clock and requirement builders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery_ojs_ml.allocator import Allocation, Allocator, Denied, Pending
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.testing.builders import worker_with


@dataclass
class FakeClock:
    """A clock the test moves by hand."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def job(**attrs: Any) -> MLRequirements:
    """Canonical requirements from attributes named without their `ext_ml_` prefix."""
    return normalize({f"ext_ml_{k}": v for k, v in attrs.items()}).requirements


def allocator(
    caps: Capabilities | None = None, clock: FakeClock | None = None, **kw: Any
) -> Allocator:
    """An allocator on a 4 x A100, 32-core, 256 GB worker unless told otherwise."""
    return Allocator(
        caps or worker_with(gpus=4, gpu_type="nvidia-a100", cpu_cores=32, ram_gb=256),
        clock=clock or FakeClock(),
        **kw,
    )


def started(result: Allocation | Pending | Denied) -> Allocation:
    """The allocation, failing the test when the request did not start."""
    assert isinstance(result, Allocation), result
    return result


def waiting(result: Allocation | Pending | Denied) -> Pending:
    """The pending request, failing the test when it did not wait."""
    assert isinstance(result, Pending), result
    return result


def run(a: Allocator, task_id: str, req: MLRequirements, **kw: Any) -> Allocation:
    """Start a job keyed by its task id; it must fit."""
    return started(a.try_alloc(task_id, task_id, req, **kw))


def hold(a: Allocator, task_id: str, req: MLRequirements, **kw: Any) -> Pending:
    """Submit a job keyed by its task id that must wait, and hold it."""
    pending = waiting(a.try_alloc(task_id, task_id, req, **kw))
    a.hold(pending)
    return pending
