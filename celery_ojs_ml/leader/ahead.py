"""Pure rules of prefetch (`leader.prefetch`): where a job may wait ahead, and when.

Key decision: these take the pass's values and return values, with no store
and no leader state, so each rule is tested on its own (test_prefetch_rules).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from celery_ojs_ml.allocator.model import Demand, rank
from celery_ojs_ml.matching import FreeCapacity
from celery_ojs_ml.matching.match import hard_reasons, match
from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation, RunningJob, WorkerState
from celery_ojs_ml.scheduler.fair import AheadShares, decayed_split, held_gpus, weighted_split
from celery_ojs_ml.scheduler.grants import job_grantable
from celery_ojs_ml.scheduler.order import OrderKey, order_key
from celery_ojs_ml.scheduler.settle import lowest_preemptible
from celery_ojs_ml.spec.classes import BANDS
from celery_ojs_ml.store.pending import ASSIGNED

from .budget_holds import BudgetHold

Note = tuple[str, float | None, str | None]

UNSEEN_START = math.inf
"""`RunningJob.started_at` of a job only a heartbeat shows (`shown_on`): not started yet
on the scheduler clock, so it is never old enough to preempt and frees nothing."""
_MOVED_S = 0.5
"""A start estimate of a job delivered ahead is written again when it moved more."""


def ahead_estimates(
    state: WorkerState, held: Sequence[str], ahead: Collection[str], now: float, overdue_s: float
) -> dict[str, float | None]:
    """When each job held ahead at a worker's gate is likely to start; `held`: their ids
    in the gate's order, `ahead`: every job delivered ahead (their ledger entries are
    not running jobs).

    The i-th starts when the i-th of the jobs running there ends, by their time limits:
    each fits in what any one of them frees (`_may_send_ahead`), and the gate starts
    them in order. A job past its limit ends `overdue_s` from now, as in the policy
    core; past the known ends the estimate is None (unknown)."""
    ends = sorted(
        now + overdue_s if end <= now else end
        for r in state.running
        if r.task_id not in ahead and (end := r.ends_at) is not None
    )
    return {task_id: ends[i] if i < len(ends) else None for i, task_id in enumerate(held)}


def _gpus(job: PendingJob) -> int:
    return int(job.req.ext_ml_gpu_count or 0)


def moved(old: float | None, new: float | None) -> bool:
    if old is None or new is None:
        return old is not new
    return abs(new - old) > _MOVED_S


def left_after(
    decision: Decision, fleet: list[WorkerState], jobs: dict[str, PendingJob]
) -> dict[str, FreeCapacity]:
    """Each worker's free capacity less what the pass assigned there."""
    left = {w.name: w.free for w in fleet}
    for a in decision.assignments:
        job = jobs.get(a.task_id)
        if job is not None and a.worker in left:
            left[a.worker] = less(left[a.worker], Demand.of(job.req))
    return left


def room(
    fleet: list[WorkerState],
    left: dict[str, FreeCapacity],
    assigned: Mapping[str, list[PendingJob]] | None = None,
    shown: Mapping[str, list[RunningJob]] | None = None,
) -> dict[str, tuple[int, int]]:
    """Per worker where jobs may wait ahead: (the rank of its lowest preemptible running
    band, the GPUs that any one of its running jobs frees when it ends).

    Only a worker the pass left with no free GPU, and whose every running job holds
    GPUs, gets an entry: a job that fits in what any one job there frees starts at the
    first end, as a pass would start it, and holding it at the gate costs nothing.
    A job that needs more would wait there through several ends, and the gate's
    backfill rule (it knows no time limits) would keep shorter jobs off the GPUs
    freed meanwhile, which the fleet scheduler backfills (docs/scheduling.md).
    `assigned`: the jobs this pass assigned, per worker; they count as running there
    (a pass woken by a job's end sees its worker idle, assigns one job and would
    otherwise send nothing ahead), each as preemptible in its band (the safe side).
    `shown`: the jobs the worker's last heartbeat shows running that hold no lease yet
    (`shown_running`); they count as running there too."""
    assigned = assigned or {}
    shown = shown or {}
    out: dict[str, tuple[int, int]] = {}
    for w in fleet:
        entry = room_on(w, left[w.name], assigned.get(w.name, ()), shown.get(w.name, ()))
        if entry is not None:
            out[w.name] = entry
    return out


def room_on(
    w: WorkerState,
    left: FreeCapacity,
    new: Sequence[PendingJob] = (),
    shown: Sequence[RunningJob] = (),
) -> tuple[int, int] | None:
    """`room`'s entry for one worker (None: none); `left`, `new`, `shown`: its own."""
    running = [*w.running, *shown]
    gpus = [r.gpus for r in running] + [int(j.req.ext_ml_gpu_count or 0) for j in new]
    if not gpus or min(gpus) < 1 or left.gpus != 0:
        return None
    below = min([lowest_preemptible(running), *(rank(j.band) for j in new)])
    return below, min(gpus)


def shown_running(
    fleet: Sequence[WorkerState], live: Mapping[str, Mapping[str, Any]]
) -> dict[str, list[RunningJob]]:
    """Per worker, the jobs its last heartbeat shows allocated that hold no lease (a
    busy worker writes a lease some milliseconds after its job starts, so a short job
    ends before it has one): to `room` and `Prefetch._turning` they run there. A band
    the heartbeat does not name counts as the lowest, preemptible (the safe side)."""
    out: dict[str, list[RunningJob]] = {}
    for w in fleet:
        jobs = shown_on(w, (live.get(w.name) or {}).get("free") or {})
        if jobs:
            out[w.name] = jobs
    return out


def shown_on(w: WorkerState, snap: Mapping[str, Any]) -> list[RunningJob]:
    """`shown_running` for one worker; `snap`: its heartbeat's `free`."""
    allocations = snap.get("allocations")
    if not allocations:
        return []
    known = {r.task_id for r in w.running}
    out: list[RunningJob] = []
    for a in allocations:
        if a.get("task_id") in known:  # leased: checked before a job is made of it
            continue
        job = _allocated(a)
        if job is not None:
            out.append(job)
    return out


def _allocated(a: Mapping[str, Any]) -> RunningJob | None:
    """A heartbeat's allocation (`Allocation.as_dict`) as a running job; None if unnamed.

    The allocation's `started_at` is on the worker's monotonic clock, which the leader
    cannot read as its own: the job starts at `UNSEEN_START` instead, so no rule that
    reads its age takes it for an old one (it has run for milliseconds: it has no lease)."""
    task_id, band, devices = a.get("task_id"), a.get("band"), a.get("devices")
    if not isinstance(task_id, str) or not isinstance(devices, list):
        return None
    known = band in BANDS
    gpus = 0 if a.get("gpu_milli") else len(devices)
    return RunningJob(
        task_id,
        str(band) if known else BANDS[-1],
        UNSEEN_START,
        gpus=gpus,
        preemptible=a.get("preemptible") is not False or not known,
    )


def assigned_jobs(decision: Decision, jobs: dict[str, PendingJob]) -> dict[str, list[PendingJob]]:
    """The jobs a pass assigned, per worker."""
    out: dict[str, list[PendingJob]] = {}
    for a in decision.assignments:
        job = jobs.get(a.task_id)
        if job is not None:
            out.setdefault(a.worker, []).append(job)
    return out


def next_waiting(decision: Decision, jobs: Mapping[str, PendingJob]) -> dict[str, str]:
    """Each job the pass left waiting -> the next one in fleet order (`order_key`)."""
    placed = {a.task_id for a in decision.assignments}
    placed |= {p.task_id for p in decision.preemptions}
    ids = [t for _, t in sorted((order_key(j), t) for t, j in jobs.items() if t not in placed)]
    return dict(itertools.pairwise(ids))


def follows(first: PendingJob, job: PendingJob) -> bool:
    """Whether `job` may follow `first` to the worker `first` waits ahead at: both of one
    queue, band and class (equal hard constraints), and placed by their class and free
    capacity alone (`scheduler.grants.job_grantable`), so that the core would place it
    where it places `first`, once `first` started there."""
    return (
        job.queue == first.queue
        and job.band == first.band
        and job.class_key == first.class_key
        and job_grantable(job)
        and job_grantable(first)
    )


def only_worker(job: PendingJob, fleet: Sequence[WorkerState], worker: str) -> bool:
    """Whether `worker` is the one available worker that could run `job` (it consumes the
    job's queue and matches its hard constraints). Jobs that follow one sent ahead there
    keep their fleet order: no other worker can start a later one first (elsewhere, a
    worker that frees first takes the next job still waiting, before those held)."""
    return not any(
        w.name != worker
        and w.available
        and job.queue in w.queues
        and match(job.req, w.caps).eligible
        for w in fleet
    )


def planned(decision: Decision) -> tuple[Reservation, ...]:
    """Where waiting jobs would start soonest, in fleet order: reservations and shadow
    estimates (`Decision.planned`; a decision built with reservations only: those)."""
    return decision.planned or decision.reservations


def ahead_note(
    decision: Decision, task_id: str, worker: str, start: float | None
) -> tuple[str, float | None, str | None]:
    """The annotation of a job delivered ahead: the pass's reason, and where it waits."""
    note = decision.annotations.get(task_id)
    reason = note.reason_pending if note is not None else "waiting for capacity"
    where = f"delivered ahead to {worker}, whose gate starts it as soon as it fits there"
    return f"{reason}; {where}", start, worker


def first_reserved(
    decision: Decision, jobs: dict[str, PendingJob]
) -> dict[str, tuple[OrderKey, str]]:
    """Per worker, the fleet-order key and id of the first waiting job planned on it."""
    out: dict[str, tuple[OrderKey, str]] = {}
    for r in planned(decision):
        job = jobs.get(r.task_id)
        if job is None:
            continue
        up = job.req.ext_ml_escalation_target_class
        if r.task_id in decision.escalations and up is not None:  # ordered in its new band
            job = dataclasses.replace(job, band=up)
        key = order_key(job)
        if r.worker not in out or key < out[r.worker][0]:
            out[r.worker] = (key, r.task_id)
    return out


def starts_now(
    job: PendingJob, fleet: list[WorkerState], left: dict[str, FreeCapacity], holder: str
) -> str | None:
    """A worker other than `holder` that consumes the job's queue and fits it now, with a
    free pool process where they are counted (elsewhere it would wait in the pool's
    queue instead of at `holder`'s gate, and could not be taken back from there)."""
    for worker in fleet:
        if worker.name == holder or not worker.available or job.queue not in worker.queues:
            continue
        free = left[worker.name]
        if free.processes is not None and free.processes < 1:
            continue
        if not hard_reasons(job.req, worker.caps, free):
            return worker.name
    return None


def less(free: FreeCapacity, used: Demand) -> FreeCapacity:
    """`free` less a job's demand (an untracked resource stays untracked)."""

    def minus(have: Any, take: Any) -> Any:
        return None if have is None else have - take

    return dataclasses.replace(
        free,
        gpus=minus(free.gpus, used.gpus),
        cpu_cores=minus(free.cpu_cores, used.cpu_cores),
        memory_gb=minus(free.memory_gb, used.memory_gb),
        tpu_chips=minus(free.tpu_chips, used.tpu_chips),
        processes=minus(free.processes, 1),
    )


def ahead_shares(
    decision: Decision,
    fleet: list[WorkerState],
    records: Mapping[str, Mapping[str, Any]],
    jobs: Mapping[str, PendingJob],
    weights: dict[str, float],
    holds: Mapping[str, BudgetHold],
    sent: Collection[str],
    inflight: list[tuple[str, int]],
    usage: Mapping[str, float] | None = None,
) -> AheadShares:
    """The queues' weighted shares and holdings (`AheadShares`). A queue's demand is what
    it holds, has held ahead (`sent`) and has waiting; with a fair-share half-life
    (`usage`: decayed means of GPUs held) the shares are those fair order with memory
    converges to (`decayed_split`)."""
    held = held_gpus(fleet, inflight)
    on: dict[str, set[str]] = {w.name: {r.queue for r in w.running} for w in fleet}
    ahead: dict[str, int] = {}
    for task_id, hold in holds.items():
        on.setdefault(hold.worker, set()).add(hold.queue)
        record = records.get(task_id)
        if task_id in sent and record and record.get("state") == ASSIGNED:
            ahead[hold.queue] = ahead.get(hold.queue, 0) + hold.gpus
    demand = {q: float(n) for q, n in held.items()}
    placed = {a.task_id for a in decision.assignments}
    placed |= {p.task_id for p in decision.preemptions}
    waiting: dict[str, int] = {}
    for job in jobs.values():
        if job.task_id in placed:  # assigned by this pass, after `inflight` was read
            held[job.queue] = held.get(job.queue, 0) + _gpus(job)
        else:
            waiting[job.queue] = waiting.get(job.queue, 0) + max(1, _gpus(job))
        demand[job.queue] = demand.get(job.queue, 0.0) + _gpus(job)
    for queue, n in ahead.items():
        demand[queue] = demand.get(queue, 0.0) + n
    total = sum(w.caps.gpu_count for w in fleet if w.available)
    if usage is None:
        return AheadShares(weighted_split(total, demand, weights), held, ahead, on, waiting)
    share = decayed_split(total, demand, weights, usage)
    return AheadShares(share, held, ahead, on, waiting)
