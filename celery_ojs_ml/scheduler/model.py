"""The fleet core's values: what it is given (jobs, workers, policy) and what it decides.

Key decision: every input is a plain frozen value that a live scheduler can
build from the store and a trace replay can build from a log, so both drive
the same `schedule()`. Times are absolute seconds on the caller's clock (the
injected `now`); a time limit of None means unknown, which the policy treats
as "may run for ever". Builders (`PendingJob.of`, `RunningJob.of`,
`WorkerState.of`) derive the defaults (band, footprint, preemptibility) the
same way the spec and the worker gate do, so callers rarely spell them out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from celery_ojs_ml.allocator.model import Demand, preemptible_of, rank
from celery_ojs_ml.allocator.sharing import FULL
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import NO_HINTS, FreeCapacity, Hints
from celery_ojs_ml.scheduler.budget import Budget
from celery_ojs_ml.spec.classes import band as band_of
from celery_ojs_ml.spec.classes import class_id
from celery_ojs_ml.spec.resources import MLRequirements

GpuAffinity = Literal["pack", "spread", "dedicated"]
"""`ext_mlx_scheduling_gpu_affinity` (OJS ML Extensions §7.1); `pack` is the default."""

GPU_AFFINITIES: tuple[GpuAffinity, ...] = ("pack", "spread", "dedicated")
DEFAULT_QUEUE = "celery"


@dataclass(frozen=True, slots=True)
class PendingJob:
    """A job admitted to the pending set and waiting for an assignment (RFC 27 alloc)."""

    task_id: str
    req: MLRequirements
    """Canonical requirements (`spec.normalize`): hard constraints, counted demand, soft rules."""
    priority: int = 0
    """Celery priority; higher is served first within a band."""
    submitted_at: float = 0.0
    """When the job was admitted, seconds on the scheduler clock (FIFO tie-break)."""
    time_limit_s: float | None = None
    """Run-time limit, s; None takes `ext_ml_timeout_seconds`, else unknown."""
    queue: str = DEFAULT_QUEUE
    """Logical queue; only workers consuming it may take the job."""
    band: str = ""
    """reserved, on-demand or spot; empty takes `spec.classes.band(req)` (§8.1)."""
    gpu_affinity: GpuAffinity = "pack"
    """`ext_mlx_scheduling_gpu_affinity`: pack (best fit), spread, or dedicated (whole worker)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """The job's own labels, matched by other jobs' anti-affinity (§7.3) once it runs."""
    class_key: str = ""
    """Requirement class (`spec.classes.class_id`); empty computes it."""
    gang: str | None = None
    """The gang (a multi-worker job, Flux RFC 25 `node>slot`) it is one rank of, if any."""
    gang_size: int = 1
    """How many ranks the gang has; all are placed at once on distinct workers, or none."""
    rank: int = 0
    not_before: float = 0.0
    """Earliest start, scheduler clock: a job given or taken back sits out a back-off. It
    keeps its place in order and takes a reservation meanwhile, so no later job that would
    delay it backfills onto the capacity it is waiting for."""
    hints: Hints = NO_HINTS
    """Its OJS ML Extensions §7 placement hints (spot preference, data locality): soft
    terms of the placement score (`matching.hints`), never a reason to wait."""
    order: tuple[int, int, float, str] = field(init=False, repr=False, compare=False)
    """Its place in fleet order (`scheduler.order.order_key`), computed once: a pass over a
    backlog of thousands sorts it on every pass."""

    def __post_init__(self) -> None:
        if self.gpu_affinity not in GPU_AFFINITIES:
            raise ValueError(
                f"gpu_affinity is {self.gpu_affinity!r}; use one of {', '.join(GPU_AFFINITIES)} "
                '(ext_mlx_scheduling_gpu_affinity, OJS ML Extensions §7.1), e.g. "pack"'
            )
        if not self.band:
            object.__setattr__(self, "band", band_of(self.req))
        if self.time_limit_s is None and self.req.ext_ml_timeout_seconds is not None:
            object.__setattr__(self, "time_limit_s", float(self.req.ext_ml_timeout_seconds))
        if not self.class_key:
            object.__setattr__(self, "class_key", class_id(self.req))
        key = (-rank(self.band), -self.priority, self.submitted_at, self.task_id)
        object.__setattr__(self, "order", key)


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job running (or assigned) on a worker, as the worker reports it."""

    task_id: str
    band: str
    started_at: float
    """When it started, seconds on the scheduler clock."""
    priority: int = 0
    gpus: int = 0
    cpu_cores: float = 0.0
    memory_gb: float = 0.0
    tpu_chips: int = 0
    time_limit_s: float | None = None
    """Run-time limit, s; None: unknown (it frees nothing in any estimate)."""
    last_checkpoint_at: float | None = None
    """When its last checkpoint was committed; None: never (all progress is at risk)."""
    preemptible: bool = False
    """§8.2 `ext_ml_preemptible` (spot defaults to true)."""
    preemption_policy: str | None = None
    """`ext_mlx_scheduling_preemption_policy`; `never` makes the job unpreemptible."""
    labels: Mapping[str, str] = field(default_factory=dict)
    exclusive: bool = False
    """Runs with gpu_affinity `dedicated`: the whole worker is its own."""
    preempted_for: str | None = None
    """Task id of the job it is being preempted for (a preemption in flight)."""
    queue: str = DEFAULT_QUEUE
    """Its logical queue: what it holds counts against that queue's budget (§10.3)."""
    reservation: str | None = None
    """The reservation it runs inside (`ext_ml_reservation_id`, §8.3), if any."""
    gpu_milli: int = 0
    """A GPU share's milli-GPU on its one device (`allocator.sharing`); 0: whole GPUs."""
    ended: bool = False
    """Its worker's heartbeat no longer shows it: it ended, and the release of its lease
    is not written yet. It holds nothing of its queue's share or budget; elsewhere it
    still counts as running (its worker's free capacity is the heartbeat's anyway)."""

    @classmethod
    def of(cls, task_id: str, req: MLRequirements, started_at: float, **kw: Any) -> RunningJob:
        """A running job's footprint, band and preemptibility from its requirements."""
        d = Demand.of(req)
        limit = req.ext_ml_timeout_seconds
        base: dict[str, Any] = {
            "band": band_of(req),
            "gpus": d.gpus,
            "cpu_cores": float(d.cpu_cores),
            "memory_gb": float(d.memory_gb),
            "tpu_chips": d.tpu_chips,
            "time_limit_s": None if limit is None else float(limit),
            "preemptible": preemptible_of(req),
            "reservation": req.ext_ml_reservation_id,
        }
        return cls(task_id=task_id, started_at=started_at, **{**base, **kw})

    @property
    def ends_at(self) -> float | None:
        """When its time limit runs out; None when unknown."""
        return None if self.time_limit_s is None else self.started_at + self.time_limit_s

    @property
    def demand(self) -> Demand:
        """The counted resources it holds."""
        return Demand(self.gpus, self.cpu_cores, self.memory_gb, self.tpu_chips)

    @property
    def yields_drain(self) -> bool:
        """Whether a larger job of a higher band could preempt it at any time (a
        preemptible spot job, not exempt by `preemption_policy: never`), so it never keeps
        its worker from draining for one (`scheduler.slot.Slot.drain_at`)."""
        return self.preemptible and self.band == "spot" and self.preemption_policy != "never"


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One worker as the registry knows it: what it has, has free, runs and consumes."""

    name: str
    caps: Capabilities
    free: FreeCapacity
    """Free capacity as the worker reported it (its gate's view, host reserves applied)."""
    queues: frozenset[str] = frozenset({DEFAULT_QUEUE})
    """Logical queues it consumes."""
    running: tuple[RunningJob, ...] = ()
    available: bool = True
    """False while the worker is briefly away: it counts for DENY, never for placement."""
    gpu_free_milli: tuple[int, ...] | None = None
    """Milli-GPU left on each device (`allocator.sharing`, 0: held whole), as the worker
    reports it with `ojs_ml_gpu_sharing` on; None: sharing off (no share job fits)."""
    nvlink_free: int | None = None
    """The most free devices that are all NVLink peers of each other, as the worker
    reports them; None: not known (any free devices do). A job that asks for `nvlink`
    and more GPUs than this does not start there now."""

    @classmethod
    def of(
        cls,
        name: str,
        caps: Capabilities,
        running: Sequence[RunningJob] = (),
        *,
        queues: frozenset[str] = frozenset({DEFAULT_QUEUE}),
        available: bool = True,
        gpu_free_milli: tuple[int, ...] | None = None,
        processes: int | None = None,
    ) -> WorkerState:
        """A worker whose free capacity is its totals less its running jobs (no host reserve).

        With `gpu_free_milli` (sharing on), only untouched devices count as free GPUs;
        with `processes` (its pool's), one per running job is busy (None: not counted).
        """
        used = Demand.total(r.demand for r in running)
        if any(r.exclusive for r in running):
            used = Demand.capacity(caps, 0, 0)
        free = Demand.capacity(caps, 0, 0).minus(used)
        gpus = free.gpus
        if gpu_free_milli is not None:
            gpus = min(gpus, sum(1 for m in gpu_free_milli if m >= FULL))
        view = FreeCapacity(
            gpus=gpus,
            cpu_cores=free.cpu_cores,
            memory_gb=free.memory_gb,
            tpu_chips=free.tpu_chips if caps.tpu else None,
            running_labels=tuple(r.labels for r in running if r.labels),
            processes=None if processes is None else max(0, processes - len(running)),
        )
        return cls(name, caps, view, queues, tuple(running), available, gpu_free_milli)


@dataclass(frozen=True, slots=True)
class Policy:
    """The knobs of the fleet policy (settings `ojs_ml_*`, docs/scheduling.md)."""

    reservation_depth: int = 1
    """`ojs_ml_reservation_depth`: how many blocked jobs, first in order, hold a reservation."""
    min_runtime_before_preemption_s: float = 60.0
    """`ojs_ml_min_runtime_before_preemption_s`: younger jobs are never preempted."""
    allow_on_demand_preemption: bool = False
    """`ojs_ml_allow_on_demand_preemption`: reserved jobs may preempt on-demand ones."""
    locality_weight: int = 50
    """`ojs_ml_locality_weight`: weight of model locality in the affinity score (§11.3)."""
    affinity_weight: float = 0.5
    """Share of the soft-constraint score in the placement score; the rest is packing."""
    preemption: bool = True
    """Plan preemptions at all."""
    preemption_grace_s: float = 30.0
    """Expected time for victims to leave; the preempting job's start estimate."""
    deny_unsatisfiable: bool = False
    """`ojs_ml_deny_unsatisfiable`: deny jobs no known worker could ever run (RFC 27 DENY)."""
    overdue_s: float = 1.0
    """A running job past its time limit is expected to end this much later. Its limit is
    a hard one (the worker kills it), and a lease's start precedes the task body's by
    the hand-off to the pool, so a job just past its limit is ending: a longer guess
    opened a backfill window behind it for jobs the reserved job then waited for (10 s
    before; with it the starvation test failed about 1 run in 20)."""
    budgets: tuple[tuple[str, Budget], ...] = ()
    """Queue GPU budgets (§10.3) from `ojs_ml_queue_policies`' `ml_limits`."""
    weights: tuple[tuple[str, float], ...] = ()
    """Fair-share weights by queue (`ojs_ml_fair_share`); empty: plain fleet order."""
    fair_share_half_life_s: float = 0.0
    """`ojs_ml_fair_share_half_life_s`: with weights, fair order also counts each queue's
    GPU use decayed with this half-life (`scheduler.usage`); 0: no memory."""
    estimate_depth: int | None = None
    """`ojs_ml_estimate_depth`: how many blocked jobs, first in order and after the
    reserved ones, get a start estimate (a shadow hold); the rest wait with
    `t_estimate` None, as Slurm's backfill tests only `bf_max_job_test` jobs. Estimates
    never bind backfill, so this changes no assignment, reservation or preemption; it
    bounds the pass's cost with a long backlog. None: every job."""
    drain_defer_s: float = 3600.0
    """A job with a time limit whose best start now would make a large worker drain 4 h
    or more later is decided after the pass's other jobs, then preferring a place that
    holds no drain (`scheduler.defer`), until it has waited this long, s; 0: never."""
    queue_depth: int | None = None
    """Decide only the first this many waiting jobs in (fair) order; None: all of them.
    The live leader sets it (`ojs_ml_queue_depth`) on passes between full ones."""
    settle: bool = False
    """Stop the pass at the first job from which every job can only wait: no worker
    has a free GPU, every reservation is taken and nothing running is preemptible by
    it (`core.Planner.settled`); the jobs left out keep their earlier annotations. Meant
    for the live leader's quick passes, which do not set it yet (docs/scheduling.md)."""

    @classmethod
    def from_settings(cls, settings: object) -> Policy:
        """The policy named by an `OJSMLSettings` (fields it lacks keep their defaults)."""
        names = (
            "reservation_depth",
            "min_runtime_before_preemption_s",
            "allow_on_demand_preemption",
            "locality_weight",
            "deny_unsatisfiable",
            "fair_share_half_life_s",
            "estimate_depth",
            "drain_defer_s",
        )
        found: dict[str, Any] = {n: getattr(settings, n) for n in names if hasattr(settings, n)}
        policies = getattr(settings, "queue_policies", None) or {}
        found["budgets"] = tuple(
            (queue, Budget(p.ml_limits.max_total_gpus, p.ml_limits.max_concurrent_gpu_jobs))
            for queue, p in sorted(policies.items())
            if p.ml_limits.max_total_gpus is not None
            or p.ml_limits.max_concurrent_gpu_jobs is not None
        )
        found["weights"] = tuple(sorted((getattr(settings, "fair_share", None) or {}).items()))
        return cls(**found)

    @property
    def counts_assignments(self) -> bool:
        """Queue GPU budgets or fair-share weights: a pass counts every assigned job as
        holding its GPUs, so the fast lane stays shut, and prefetch (whose jobs wait
        assigned) leaves out budgeted queues' jobs, or every job under weights."""
        return bool(self.budgets or self.weights)


DEFAULT_POLICY = Policy()


@dataclass(frozen=True, slots=True)
class Assignment:
    """Run `task_id` on `worker` now (RFC 27 alloc SUCCESS); the gate pins the devices."""

    task_id: str
    worker: str
    score: float
    """Placement score 0-100 of the chosen worker (`scheduler.score`)."""
    devices: tuple[int, ...] | None = None
    """Device indices, when the caller chooses them; None leaves them to the worker gate."""


@dataclass(frozen=True, slots=True)
class Annotation:
    """RFC 27 annotate for a waiting job: why it waits and when it should start."""

    task_id: str
    reason_pending: str
    """The pending message, in matching's words (`matching.pending_message`)."""
    t_estimate: float | None
    """Estimated start, seconds since the epoch on the scheduler clock; None: unknown."""
    worker: str | None = None
    """The worker reserved for it, or whose jobs it is preempting."""

    def as_dict(self) -> dict[str, Any]:
        """RFC 27 `sched` annotations."""
        return {"reason_pending": self.reason_pending, "t_estimate": self.t_estimate}


@dataclass(frozen=True, slots=True)
class Reservation:
    """Capacity on `worker` held for `task_id` from `start` (None: when it frees, unknown)."""

    task_id: str
    worker: str
    start: float | None


@dataclass(frozen=True, slots=True)
class Preemption:
    """Preempt `victims` on `worker` so that `task_id` can start there."""

    task_id: str
    worker: str
    victims: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Denial:
    """RFC 27 DENY: no known worker could ever run the job; `note` says why."""

    task_id: str
    note: str
    unplaceable: bool = False
    """True: no known worker could ever run it (`Policy.deny_unsatisfiable`); False: it
    can never run inside its reservation (§8.3, `scheduler.pools`)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Everything one pass decided; assignments are in fleet order (publish in this order)."""

    assignments: tuple[Assignment, ...] = ()
    annotations: Mapping[str, Annotation] = field(default_factory=dict)
    reservations: tuple[Reservation, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    denials: tuple[Denial, ...] = ()
    budgets: Mapping[str, Mapping[str, int | None]] = field(default_factory=dict)
    """Each budgeted queue's use after the pass (`BudgetBook.report`), for `status`."""
    escalations: Mapping[str, str] = field(default_factory=dict)
    """Jobs this pass saw escalated (§8.4): task id -> the band they were submitted in."""
    planned: tuple[Reservation, ...] = ()
    """Where each waiting job with a known start would start soonest, in fleet order: the
    `reservations`, and the shadow estimates after them (which backfill does not respect).
    Prefetch sends the first of them on each worker ahead (`leader.prefetch`)."""

    def assigned(self) -> dict[str, str]:
        """task id -> worker of every assignment."""
        return {a.task_id: a.worker for a in self.assignments}
