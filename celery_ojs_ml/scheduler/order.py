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

from celery_ojs_ml.matching import NO_HINTS
from celery_ojs_ml.scheduler.model import PendingJob
from celery_ojs_ml.scheduler.vectors import Vec, demand_of
from celery_ojs_ml.spec.resources import MLRequirements

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
        want, soft = _derived(job.req)
        end = None if job.time_limit_s is None else now + job.time_limit_s
        return cls(job, order or order_key(job), want, end, (*soft, job.hints))

    @property
    def dedicated(self) -> bool:
        """Whether it takes a whole worker (`gpu_affinity: dedicated`)."""
        return self.job.gpu_affinity == "dedicated"

    @property
    def yields_drain(self) -> bool:
        """Whether, once running, it is a preemptible spot job (§8.2; `RunningJob.yields_drain`:
        `preemption_policy: never`, read from the running job's headers, counts from then)."""
        return self.job.band == "spot" and self.job.req.ext_ml_preemptible is not False


class Asks:
    """`Ask.of` for one pass, deriving what depends on the requirements alone once per
    requirements object: the admission parses identical declarations into one object, so
    100,000 pending jobs share a handful and a pass need not count each one's footprint.
    Jobs without hints of their own share one soft-score key too."""

    __slots__ = ("_derived", "now")

    def __init__(self, now: float) -> None:
        self.now = now
        self._derived: dict[int, tuple[MLRequirements, Vec, Hashable, tuple[Hashable, ...]]] = {}

    def of(self, job: PendingJob, order: OrderKey | None = None) -> Ask:
        """`Ask.of(job, now, order)`."""
        req = job.req
        hit = self._derived.get(id(req))
        if hit is None or hit[0] is not req:  # the entry holds req, so its id is not reused
            want, soft = _derived(req)
            hit = self._derived[id(req)] = (req, want, (*soft, NO_HINTS), soft)
        soft_key = hit[2] if job.hints is NO_HINTS else (*hit[3], job.hints)
        limit = job.time_limit_s
        end = None if limit is None else self.now + limit
        return Ask(job, order or job.order, hit[1], end, soft_key)


def _derived(req: MLRequirements) -> tuple[Vec, tuple[Hashable, ...]]:
    """The footprint, and what the soft score reads of the requirements (the job's
    hints aside)."""
    preferred = req.ext_ml_affinity.preferred if req.ext_ml_affinity else ()
    return demand_of(req), (preferred, req.ext_ml_model_id, req.ext_ml_model_version)
