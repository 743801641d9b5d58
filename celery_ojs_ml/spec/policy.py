"""Queue-level ML defaults and limits (OJS ML §10.1-§10.2).

Key decision: defaults are filled before validation (so they obey the same
rules as producer values) and limits are checked after normalisation (so
inferred values, such as a default GPU count of one, are limited too).
Budgets (§10.3) are not rejections: they hold jobs at runtime and are enforced
by the worker side, never here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from celery_ojs_ml.errors import Violation
from celery_ojs_ml.spec.resources import MLRequirements, PriorityClass

_SECTION = "OJS ML §10.2"


class QueueLimits(BaseModel):
    """The §10.2 `ml_limits` block of one queue."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_gpu_count: int | None = Field(default=None, ge=0)
    max_gpu_memory_gb: float | None = Field(default=None, ge=0)
    max_memory_gb: float | None = Field(default=None, ge=0)
    max_timeout_seconds: int | None = Field(default=None, ge=1)
    allowed_gpu_types: tuple[str, ...] | None = None
    allowed_priority_classes: tuple[PriorityClass, ...] | None = None
    max_concurrent_gpu_jobs: int | None = Field(default=None, ge=0)
    max_total_gpus: int | None = Field(default=None, ge=0)


class QueuePolicy(BaseModel):
    """A queue's `ml_defaults` (§10.1) and `ml_limits` (§10.2)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ml_defaults: dict[str, Any] = Field(default_factory=dict)
    ml_limits: QueueLimits = Field(default_factory=QueueLimits)


def apply_defaults(attrs: Mapping[str, Any], policy: QueuePolicy | None) -> dict[str, Any]:
    """Fill every attribute the producer did not set from the queue defaults (§10.1 MUST)."""
    if policy is None or not policy.ml_defaults:
        return dict(attrs)
    return {**policy.ml_defaults, **attrs}


def limit_violations(m: MLRequirements, queue: str, policy: QueuePolicy | None) -> list[Violation]:
    """Every way the normalised requirements exceed the queue's limits (§10.2 MUST reject)."""
    if policy is None:
        return []
    lim = policy.ml_limits
    out = [
        _over(attr, value, limit, queue)
        for attr, value, limit in (
            ("ext_ml_gpu_count", m.ext_ml_gpu_count, lim.max_gpu_count),
            ("ext_ml_gpu_memory_gb", m.ext_ml_gpu_memory_gb, lim.max_gpu_memory_gb),
            ("ext_ml_memory_gb", m.ext_ml_memory_gb, lim.max_memory_gb),
            ("ext_ml_timeout_seconds", m.ext_ml_timeout_seconds, lim.max_timeout_seconds),
        )
        if value is not None and limit is not None and value > limit
    ]
    out += _not_allowed("ext_ml_gpu_type", m.ext_ml_gpu_type, lim.allowed_gpu_types, queue)
    klass = m.ext_ml_priority_class or "on-demand"
    out += _not_allowed("ext_ml_priority_class", klass, lim.allowed_priority_classes, queue)
    return out


def _over(attr: str, value: float, limit: float, queue: str) -> Violation:
    return Violation(
        attr,
        f"is {value:g}, above queue {queue!r}'s limit of {limit:g}",
        _SECTION,
        f"request at most {limit:g} or submit to another queue",
    )


def _not_allowed(
    attr: str, value: str | None, allowed: tuple[str, ...] | None, queue: str
) -> list[Violation]:
    if value is None or allowed is None or value in allowed:
        return []
    return [
        Violation(
            attr,
            f"{value!r} is not allowed on queue {queue!r}",
            _SECTION,
            f"use one of {list(allowed)}",
        )
    ]
