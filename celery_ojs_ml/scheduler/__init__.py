"""The fleet policy core: order, reserve and backfill, place, preempt, annotate. Pure.

`schedule(pending, fleet, now, policy)` takes plain values and returns a
`Decision`; it has no Celery, no I/O and no clock of its own, so the live
scheduler and the trace-replay benchmark drive the same code.
"""

from celery_ojs_ml.scheduler.budget import Budget
from celery_ojs_ml.scheduler.core import Planner, schedule
from celery_ojs_ml.scheduler.fleet import Memo
from celery_ojs_ml.scheduler.model import (
    DEFAULT_POLICY,
    Annotation,
    Assignment,
    Decision,
    Denial,
    GpuAffinity,
    PendingJob,
    Policy,
    Preemption,
    Reservation,
    RunningJob,
    WorkerState,
)
from celery_ojs_ml.scheduler.order import in_order, order_key
from celery_ojs_ml.scheduler.pools import ReservationPool
from celery_ojs_ml.scheduler.preempt import lost_work_s, may_preempt
from celery_ojs_ml.scheduler.score import PlacementScore, Workload, score_placement

__all__ = [
    "DEFAULT_POLICY",
    "Annotation",
    "Assignment",
    "Budget",
    "Decision",
    "Denial",
    "GpuAffinity",
    "Memo",
    "PendingJob",
    "PlacementScore",
    "Planner",
    "Policy",
    "Preemption",
    "Reservation",
    "ReservationPool",
    "RunningJob",
    "WorkerState",
    "Workload",
    "in_order",
    "lost_work_s",
    "may_preempt",
    "order_key",
    "schedule",
    "score_placement",
]
