"""Fleet order, and a pending job as one pass sees it.

Key decision: one total order for the whole fleet: band (reserved >
on-demand > spot, §8.1), then Celery priority (higher first), then submit
time (FIFO), then task id, so two passes over the same input decide the same.
The next layers (escalation, budgets) change the band or priority they pass
in, never this order.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from operator import attrgetter

from celery_ojs_ml.scheduler.model import PendingJob
from celery_ojs_ml.scheduler.vectors import Vec, demand_of

OrderKey = tuple[int, int, float, str]
_ORDER = attrgetter("order")


def order_key(job: PendingJob) -> OrderKey:
    """The job's place in fleet order; smaller goes first: band (`rank`), priority, submit
    time, task id (computed once, by `PendingJob`)."""
    return job.order


def in_order(pending: Iterable[PendingJob]) -> list[PendingJob]:
    """Pending jobs in fleet order."""
    return sorted(pending, key=_ORDER)


@dataclass(frozen=True, slots=True)
class Ask:
    """A pending job with what the pass derives from it once."""

    job: PendingJob
    order: OrderKey
    want: Vec
    """Counted footprint (`vectors.demand_of`)."""
    end: float | None
    """When it would end if started now; None: no known time limit."""
    soft: Hashable
    """What its soft score depends on besides the worker (preferred rules, model, hints)."""

    @classmethod
    def of(cls, job: PendingJob, now: float, order: OrderKey | None = None) -> Ask:
        """Derive once what every step of the pass needs (`order`: a fair-share order)."""
        req = job.req
        preferred = req.ext_ml_affinity.preferred if req.ext_ml_affinity else ()
        soft = (preferred, req.ext_ml_model_id, req.ext_ml_model_version, job.hints)
        end = None if job.time_limit_s is None else now + job.time_limit_s
        return cls(job, order or order_key(job), demand_of(req), end, soft)

    @property
    def dedicated(self) -> bool:
        """Whether it takes a whole worker (`gpu_affinity: dedicated`)."""
        return self.job.gpu_affinity == "dedicated"
