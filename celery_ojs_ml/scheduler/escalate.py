"""Priority escalation (OJS ML §8.4): a job that waited long enough is scheduled higher.

Key decision: escalation changes only the band a pass sees (order, preemption
rights, reservations all follow from it), never the stored job: every pass
decides again from the submit time, so a new leader escalates the same jobs
at the same moment, and nothing has to be written for it to hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from celery_ojs_ml.allocator.model import rank
from celery_ojs_ml.scheduler.model import PendingJob

DEFAULT_AFTER_S = 3600
"""§8.4 default of `ext_ml_escalation_after_s`."""


def escalated(job: PendingJob, now: float) -> PendingJob | None:
    """`job` in its escalation target band once it has waited `escalation_after_s`; else None."""
    req = job.req
    target = req.ext_ml_escalation_target_class
    if not req.ext_ml_priority_escalation or target is None:
        return None
    after = req.ext_ml_escalation_after_s or DEFAULT_AFTER_S
    if now - job.submitted_at < after or rank(target) <= rank(job.band):
        return None
    return replace(job, band=target)


def escalate_all(
    pending: Iterable[PendingJob], now: float
) -> tuple[list[PendingJob], dict[str, str]]:
    """Every job as this pass sees it, and `{task id: from band}` of the escalated ones."""
    jobs: list[PendingJob] = []
    changed: dict[str, str] = {}
    for job in pending:
        up = escalated(job, now)
        if up is not None:
            changed[job.task_id] = job.band
            job = up
        jobs.append(job)
    return jobs, changed
