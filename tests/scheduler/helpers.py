"""Builders for scheduler tests: requirements, pending and running jobs, workers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_ojs_ml.capabilities import Capabilities, resolve_capabilities
from celery_ojs_ml.scheduler import Decision, PendingJob, Policy, RunningJob, WorkerState, schedule
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import MLRequirements

NOW = 10_000.0


def req(**attrs: Any) -> MLRequirements:
    """Canonical requirements from attributes named without their `ext_ml_` prefix."""
    return normalize({f"ext_ml_{k}": v for k, v in attrs.items()}).requirements


def caps(profile: str, name: str | None = None) -> Capabilities:
    """Capabilities of a profile (`nvidia-a100x8`, `nvidia-l4x1`, ...)."""
    found = resolve_capabilities(f"profile:{profile}")
    return found.model_copy(update={"worker_id": name}) if name else found


def job(
    task_id: str,
    *,
    at: float = 0.0,
    priority: int = 0,
    limit: float | None = None,
    queue: str = "celery",
    gpu_affinity: str = "pack",
    **attrs: Any,
) -> PendingJob:
    """A pending job submitted at `at` with time limit `limit` (None: unknown)."""
    return PendingJob(
        task_id,
        req(**attrs),
        priority=priority,
        submitted_at=at,
        time_limit_s=limit,
        queue=queue,
        gpu_affinity=gpu_affinity,  # type: ignore[arg-type]
    )


def running(
    task_id: str, *, started: float = NOW - 600, limit: float | None = None, **attrs: Any
) -> RunningJob:
    """A running job; `band`, `checkpoint`, `preempted_for` etc. pass through as fields."""
    fields = {k: attrs.pop(k) for k in list(attrs) if k in RunningJob.__dataclass_fields__}
    if "checkpoint" in attrs:
        fields["last_checkpoint_at"] = attrs.pop("checkpoint")
    return RunningJob.of(task_id, req(**attrs), started, time_limit_s=limit, **fields)


def worker(
    name: str, profile: str = "nvidia-a100x8", jobs: Sequence[RunningJob] = (), **kw: Any
) -> WorkerState:
    """A worker from a profile, running `jobs`."""
    return WorkerState.of(name, caps(profile, name), jobs, **kw)


def decide(
    pending: Sequence[PendingJob],
    fleet: Sequence[WorkerState],
    now: float = NOW,
    **policy: Any,
) -> Decision:
    """One scheduling pass."""
    return schedule(pending, fleet, now, Policy(**policy))


def decision_facts(decision: Decision) -> tuple[object, ...]:
    """Everything a pass decided, for comparing two passes over the same inputs."""
    return (
        [(a.task_id, a.worker, a.score) for a in decision.assignments],
        sorted((r.task_id, r.worker, r.start) for r in decision.reservations),
        sorted((p.task_id, p.worker, p.victims) for p in decision.preemptions),
        sorted((t, a.reason_pending, a.t_estimate) for t, a in decision.annotations.items()),
        sorted((r.task_id, r.worker, r.start) for r in decision.planned),
    )
