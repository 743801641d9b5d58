"""Where a pass may send jobs ahead (`leader.ahead.room`): the jobs the pass itself
assigned count as running on their worker.

A pass woken by a job's end sees its worker idle, assigns it the next job and, before
this rule, sent nothing ahead: every following request then waited for another pass.
"""

from __future__ import annotations

from celery_ojs_ml.allocator.model import rank
from celery_ojs_ml.leader.ahead import assigned_jobs, left_after, room
from celery_ojs_ml.scheduler import Decision, PendingJob, WorkerState
from celery_ojs_ml.scheduler.model import Assignment
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.testing.builders import worker_with


def _job(task_id: str, band: str = "on-demand", gpus: int = 1) -> PendingJob:
    req = normalize({"ext_ml_gpu_count": gpus}).requirements
    return PendingJob(task_id=task_id, req=req, band=band)


def _pass(jobs: list[PendingJob], on: str) -> tuple[Decision, dict[str, PendingJob]]:
    decision = Decision(assignments=tuple(Assignment(j.task_id, on, 100.0) for j in jobs))
    return decision, {j.task_id: j for j in jobs}


def test_an_idle_worker_the_pass_fills_gets_room_for_jobs_ahead() -> None:
    fleet = [WorkerState.of("w", worker_with(gpus=1))]
    decision, jobs = _pass([_job("next", band="on-demand")], on="w")
    left = left_after(decision, fleet, jobs)
    assert room(fleet, left) == {}, "without the pass's assignments the worker looks idle"
    assert room(fleet, left, assigned_jobs(decision, jobs)) == {"w": (rank("on-demand"), 1)}


def test_a_worker_the_pass_leaves_a_gpu_free_on_gets_no_room() -> None:
    fleet = [WorkerState.of("w", worker_with(gpus=2))]
    decision, jobs = _pass([_job("next")], on="w")
    left = left_after(decision, fleet, jobs)
    assert room(fleet, left, assigned_jobs(decision, jobs)) == {}


def test_a_spot_job_the_pass_assigned_counts_as_preemptible_there() -> None:
    """A job held ahead above a spot job it could preempt is a pass's decision: the
    assigned spot job lowers the worker's preemptible rank as a running one would."""
    fleet = [WorkerState.of("w", worker_with(gpus=1))]
    decision, jobs = _pass([_job("spot-1", band="spot")], on="w")
    left = left_after(decision, fleet, jobs)
    assert room(fleet, left, assigned_jobs(decision, jobs)) == {"w": (rank("spot"), 1)}
