"""Dynamic reservations (OJS ML §8.3) in the fleet pass: place them, keep them, fill them.

Key decisions:
- A reservation waiting to be placed is an ordinary pending job
  (`ReservationPool.as_job`, task id `reservation:<id>`), so it is ordered,
  placed, reserved for and estimated like any job; an assignment of it is a
  placement, which the live layer records instead of publishing.
- A placed reservation holds its capacity on its worker as a running job that
  nothing may preempt (`hold`), until it ends.
- A job naming a reservation never enters the general pass (`fill`): it waits for
  room on the reservation's worker, in fleet order. A job whose reservation ended
  is denied: §8.3 forbids running it anywhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from celery_ojs_ml.allocator.model import Demand
from celery_ojs_ml.matching import FreeCapacity, Verdict, match, pending_message
from celery_ojs_ml.matching.filters import fmt
from celery_ojs_ml.scheduler.memo import Memo
from celery_ojs_ml.scheduler.model import (
    Annotation,
    Assignment,
    Decision,
    Denial,
    PendingJob,
    RunningJob,
    WorkerState,
)
from celery_ojs_ml.scheduler.order import in_order
from celery_ojs_ml.spec.resources import MLRequirements

PREFIX = "reservation:"
"""Task-id prefix of a reservation's pending job and of the running job that holds it."""


@dataclass(frozen=True, slots=True)
class ReservationPool:
    """One dynamic reservation as the scheduler sees it."""

    rid: str
    req: MLRequirements
    """What it reserves, in the job vocabulary (`ext_ml_*`)."""
    created_at: float
    worker: str | None = None
    """Where it is placed; None: not placed yet."""
    expires_at: float | None = None
    """When it ends (scheduler clock); None: at release only."""
    held: bool = False
    """The worker's gate reports holding it: its free capacity already leaves it out."""
    ended: bool = False
    """Released or expired (kept a while so that jobs naming it are denied, not left waiting)."""
    priority: int = 0

    @property
    def task_id(self) -> str:
        return PREFIX + self.rid

    @property
    def demand(self) -> Demand:
        return Demand.of(self.req)

    def as_job(self) -> PendingJob:
        """The pending job that places it (its time limit: until it expires)."""
        left = None if self.expires_at is None else max(1.0, self.expires_at - self.created_at)
        return PendingJob(
            self.task_id,
            self.req,
            priority=self.priority,
            submitted_at=self.created_at,
            time_limit_s=left,
            queue=_ANY_QUEUE,
        )


_ANY_QUEUE = "\x00any"
"""A reservation is placed on any worker, whatever queues it consumes (see `open_queues`)."""


def open_queues(fleet: Sequence[WorkerState], memo: Memo | None = None) -> list[WorkerState]:
    """Every worker also consumes `_ANY_QUEUE`, the queue of reservations being placed
    (with `memo`, made once per worker state object: the same one comes back while the
    worker is unchanged)."""
    if memo is None:
        return [_opened(w) for w in fleet]
    return memo.derived(fleet, _opened)


def _opened(w: WorkerState) -> WorkerState:
    return replace(w, queues=w.queues | {_ANY_QUEUE})


def hold(
    fleet: Sequence[WorkerState], pools: Iterable[ReservationPool], now: float
) -> list[WorkerState]:
    """Each placed reservation's unused capacity held on its worker as an unpreemptible job.

    Until the worker's gate reports holding it, its capacity is also taken off the
    worker's reported free capacity, so no job slips in during the gap.
    """
    placed: dict[str, list[ReservationPool]] = {}
    for pool in pools:
        if pool.worker is not None and not pool.ended:
            placed.setdefault(pool.worker, []).append(pool)
    out = []
    for w in fleet:
        mine = placed.get(w.name)
        out.append(w if not mine else _held_on(w, mine, now))
    return out


def _held_on(w: WorkerState, pools: list[ReservationPool], now: float) -> WorkerState:
    free, extra = w.free, []
    running = _kept_in(w.running, pools)
    for pool in pools:
        inside = Demand.total(r.demand for r in w.running if r.reservation == pool.rid)
        left = pool.demand.minus(inside)
        limit = None if pool.expires_at is None else max(0.0, pool.expires_at - pool.created_at)
        extra.append(
            RunningJob(
                pool.task_id,
                "reserved",
                pool.created_at,
                gpus=left.gpus,
                cpu_cores=float(left.cpu_cores),
                memory_gb=float(left.memory_gb),
                tpu_chips=left.tpu_chips,
                time_limit_s=limit,
                preemption_policy="never",
                queue=_ANY_QUEUE,
            )
        )
        if not pool.held:
            free = less_free(free, left)
    return replace(w, free=free, running=(*running, *extra))


def _kept_in(running: Sequence[RunningJob], pools: list[ReservationPool]) -> list[RunningJob]:
    """The running jobs as everyone outside the reservations sees them: a job inside one
    gives its capacity back to the reservation, not to the fleet, so it is held until
    the later of its own end and the reservation's (never: no end), and no job outside
    may preempt it to take that capacity."""
    ends = {p.rid: p.expires_at for p in pools}
    out = []
    for r in running:
        if r.reservation not in ends:
            out.append(r)
            continue
        pool_end, own = ends[r.reservation], r.time_limit_s
        end = None if pool_end is None or own is None else max(pool_end, r.started_at + own)
        limit = None if end is None else end - r.started_at
        out.append(replace(r, time_limit_s=limit, preemption_policy="never"))
    return out


def less_free(free: FreeCapacity, d: Demand) -> FreeCapacity:
    """`free` less `d` (floored at zero; untracked resources stay untracked)."""

    def cut(have: float | None, take: float) -> float | None:
        return None if have is None else max(0.0, have - take)

    gpus = None if free.gpus is None else max(0, free.gpus - d.gpus)
    tpu = None if free.tpu_chips is None else max(0, free.tpu_chips - d.tpu_chips)
    return replace(
        free,
        gpus=gpus,
        cpu_cores=cut(free.cpu_cores, float(d.cpu_cores)),
        memory_gb=cut(free.memory_gb, float(d.memory_gb)),
        tpu_chips=tpu,
        processes=None if free.processes is None else max(0, free.processes - 1),
    )


@dataclass
class Filled:
    """What `fill` decided for the jobs that name a reservation."""

    assignments: list[Assignment]
    annotations: dict[str, Annotation]
    denials: list[Denial]


def fill(
    jobs: Iterable[PendingJob],
    pools: Mapping[str, ReservationPool],
    fleet: Sequence[WorkerState],
) -> Filled:
    """Assign each job to its reservation's worker while it fits what is left (see module doc)."""
    workers = {w.name: w for w in fleet}
    left: dict[str, Demand] = {}
    out = Filled([], {}, [])
    for job in in_order(jobs):
        rid = str(job.req.ext_ml_reservation_id)
        pool = pools[rid]
        if pool.ended:
            out.denials.append(Denial(job.task_id, _ended(rid)))
            continue
        worker = workers.get(pool.worker or "")
        if worker is None or not worker.available:
            where = "is not placed yet" if pool.worker is None else f"is on {pool.worker}, away"
            note = f"reservation {rid!r} {where}; the job waits for it (§8.3)"
            out.annotations[job.task_id] = Annotation(job.task_id, note, None, pool.worker)
            continue
        room = left.get(rid)
        if room is None:
            inside = Demand.total(r.demand for r in worker.running if r.reservation == rid)
            room = pool.demand.minus(inside)
        _fill_one(job, pool, worker, room, left, out)
    return out


def _fill_one(
    job: PendingJob,
    pool: ReservationPool,
    worker: WorkerState,
    room: Demand,
    left: dict[str, Demand],
    out: Filled,
) -> None:
    want = Demand.of(job.req)
    too_big = want.short_of(pool.demand)
    view = FreeCapacity(
        gpus=room.gpus,
        cpu_cores=float(room.cpu_cores),
        memory_gb=float(room.memory_gb),
        tpu_chips=room.tpu_chips if worker.caps.tpu else None,
        running_labels=worker.free.running_labels,
        reservations=frozenset({pool.rid}),
        processes=worker.free.processes,
    )
    found = match(job.req, worker.caps, view)
    if too_big or found.verdict is Verdict.NEVER:
        why = pending_message([found])
        if too_big:
            why = f"needs more {', '.join(too_big)} than it holds"
        note = f"the job can never run inside reservation {pool.rid!r} on {worker.name}: {why}"
        out.denials.append(Denial(job.task_id, note))
    elif found.verdict is Verdict.FITS and not want.short_of(room):
        left[pool.rid] = room.minus(want)
        out.assignments.append(Assignment(job.task_id, worker.name, found.score))
    else:
        left[pool.rid] = room
        msg = ", ".join(dict.fromkeys(r.message for r in found.reasons)) or _short(want, room)
        note = f"waits inside reservation {pool.rid!r} on {worker.name}: {msg}"
        out.annotations[job.task_id] = Annotation(job.task_id, note, None, worker.name)


def _short(want: Demand, room: Demand) -> str:
    have, need = dict(room.items()), dict(want.items())
    return ", ".join(f"{n} {fmt(need[n])} > {fmt(have[n])} left" for n in want.short_of(room))


def _ended(rid: str) -> str:
    return (
        f"reservation {rid!r} ended (released or expired) before the job started; OJS ML §8.3 "
        "forbids running it outside its reservation: reserve again and resubmit"
    )


def with_pools(
    decision: Decision,
    gangs: Mapping[str, Annotation],
    jobs: Sequence[PendingJob],
    held: Mapping[str, ReservationPool],
    fleet: Sequence[WorkerState],
    now: float,
) -> Decision:
    """A pass's decision with the jobs inside the reservations placed in their pools, and
    the reasons of the gangs the pass did not decide (`scheduler.gang`)."""
    inside = [
        j
        for j in jobs
        if j.req.ext_ml_reservation_id in held and j.gang is None and j.not_before <= now
    ]
    filled = fill(inside, held, fleet) if held else Filled([], {}, [])
    if not (gangs or held):
        return decision
    return replace(
        decision,
        assignments=(*filled.assignments, *decision.assignments),
        annotations={**decision.annotations, **filled.annotations, **gangs},
        denials=(*decision.denials, *filled.denials),
    )
