"""`Decision.planned`: where each waiting job with a known start would start soonest."""

from __future__ import annotations

from celery_ojs_ml.scheduler import PendingJob, RunningJob, schedule
from celery_ojs_ml.scheduler.model import Policy, WorkerState
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.testing.builders import worker_with


def test_planned_holds_the_reservation_then_the_shadow_estimates_in_fleet_order() -> None:
    """Reservation depth 1: the first blocked job is reserved, the next ones get shadow
    estimates; `planned` lists all three with their worker and start, in fleet order,
    and `reservations` only the first. A job with no known start is not planned."""
    req = normalize({"ext_ml_gpu_count": 1, "ext_ml_timeout_seconds": 5}).requirements
    running = [RunningJob(f"r{i}", "on-demand", started_at=99.0, gpus=1, time_limit_s=3.0 + i)
               for i in range(2)]  # fmt: skip
    fleet = [WorkerState.of("w", worker_with(gpus=2), running)]
    jobs = [PendingJob(f"j{i}", req, submitted_at=float(i)) for i in range(3)]
    decision = schedule(jobs, fleet, 100.0, Policy(reservation_depth=1))
    assert [r.task_id for r in decision.reservations] == ["j0"]
    assert [(r.task_id, r.worker) for r in decision.planned] == [
        ("j0", "w"),
        ("j1", "w"),
        ("j2", "w"),
    ]
    starts = [r.start for r in decision.planned]
    assert starts[0] == 102.0 and starts == sorted(starts), starts
    blind = [WorkerState.of("w", worker_with(gpus=1), [RunningJob("r", "on-demand", 99.0, gpus=1)])]
    unknown = schedule(jobs[:2], blind, 100.0, Policy(reservation_depth=1))
    assert [r.task_id for r in unknown.planned] == ["j0"], "no start known for j1"
