"""The live scheduler's view of the fleet: store records -> the policy core's values.

Responsibility: turn pending records, live-worker heartbeats and leases into
`PendingJob` and `WorkerState` for `scheduler.schedule`.

Key decision: workers report, the scheduler decides. A worker's free capacity
is what its gate last advertised, less what the leader assigned since (the
`ledger.Ledger`) and the jobs started under a grant that its heartbeat does
not show yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeGuard

from celery_ojs_ml.allocator.model import Demand
from celery_ojs_ml.allocator.sharing import FULL, after, place, share_milli, untouched
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import FreeCapacity, Hints
from celery_ojs_ml.scheduler import PendingJob, RunningJob, WorkerState
from celery_ojs_ml.spec.classes import BANDS
from celery_ojs_ml.spec.flux_rules import is_int
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.labels import job_labels

from .fleet_memo import JobsMemo, Memos, RunningMemo, StateMemo

Parse = Callable[[Mapping[str, Any]], MLRequirements | None]
"""Message headers -> requirements (the gate's `InboundCheck.requirements`)."""

_AFFINITY = ("pack", "spread", "dedicated")


HEADER_GANG = h.GANG
"""`{"id", "size", "rank"}`: the job is one rank of a gang (`OJSML.gang`, Flux node>slot)."""
_MAX_GANG = 1024


def pending_job(task_id: str, record: Mapping[str, Any], parse: Parse) -> PendingJob | None:
    """A waiting record as the core's `PendingJob`; None when its headers do not parse."""
    msg = record.get("msg") or {}
    meta = record.get("meta") or {}
    headers = msg.get("headers") or {}
    req = parse(headers)
    if req is None:
        return None
    affinity = headers.get("ext_mlx_scheduling_gpu_affinity")
    priority = record.get("priority", meta.get("priority", 0))
    limit = meta.get("time_limit_s")
    band, queue = meta.get("band"), meta.get("queue")
    return PendingJob(
        task_id=task_id,
        req=req,
        priority=int(priority or 0),
        submitted_at=float(meta.get("submitted_at") or 0.0),
        time_limit_s=None if limit is None else float(limit),
        queue=queue if isinstance(queue, str) and queue else "celery",
        band=band if band in BANDS else "",  # a foreign `ojs_band` is recomputed, not trusted
        gpu_affinity=affinity if affinity in _AFFINITY else "pack",
        labels=job_labels(headers.get("task"), headers),
        hints=Hints.of(headers),  # ext_mlx_scheduling_spot_preference, _data_locality
        **gang_of(headers),
    )


def gang_of(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The `ojs_gang` header as `PendingJob` fields ({} for a job that is not a rank)."""
    found = headers.get(HEADER_GANG)
    if not isinstance(found, Mapping):
        return {}
    gid, size, rank = found.get("id"), found.get("size"), found.get("rank")
    if not (isinstance(gid, str) and isinstance(size, int) and isinstance(rank, int)):
        return {}
    if not 0 <= rank < size <= _MAX_GANG:
        return {}
    return {"gang": gid, "gang_size": size, "rank": rank}


def worker_states(
    live: Mapping[str, Mapping[str, Any]],
    leases: list[dict[str, Any]],
    used: Mapping[str, Demand],
    parse: Parse,
    memos: Memos,
    checkpoints: Mapping[str, float] | None = None,
    inflight_labels: Mapping[str, list[Mapping[str, str]]] | None = None,
    inflight_shares: Mapping[str, list[MLRequirements]] | None = None,
    inflight_jobs: Mapping[str, int] | None = None,
    shown: Mapping[str, frozenset[str]] | None = None,
) -> list[WorkerState]:
    """Every live worker with its free capacity (less the ledger) and its running jobs.

    `checkpoints` maps a running job to when its last checkpoint was committed;
    `inflight_shares` are GPU shares assigned since a worker's last heartbeat, and
    `inflight_jobs` the number of jobs (`Ledger.jobs`); `shown` is `allocated_ids(live)`
    where the caller has it already.
    """
    shown = allocated_ids(live) if shown is None else shown
    caps, jobs, kept, states = memos
    running, unseen = _lease_jobs(leases, live, shown, parse, checkpoints or {}, (jobs, kept))
    inflight = _Inflight(used, inflight_labels or {}, inflight_shares or {}, inflight_jobs or {})
    found = [
        _kept_state(states, name, entry, caps.caps(name, entry), running.get(name, []),
                    unseen.get(name, []), inflight)
        for name, entry in sorted(live.items())
    ]  # fmt: skip
    for memo in memos:
        memo.end_pass()
    return found


def _kept_state(
    memo: StateMemo,
    name: str,
    entry: Mapping[str, Any],
    caps: Capabilities,
    running: list[RunningJob],
    late: list[RunningJob],
    inflight: _Inflight,
) -> WorkerState:
    """`_worker_state`, made again only when something it reads changed."""
    source = (entry.get("free"), entry.get("info"), caps, tuple(running), tuple(late),
              inflight.used.get(name), inflight.labels.get(name), inflight.shares.get(name),
              inflight.jobs.get(name))  # fmt: skip
    return memo.state(
        name, source, partial(_worker_state, name, entry, caps, running, late, inflight)
    )


@dataclass(frozen=True, slots=True)
class _Inflight:
    """What the leader assigned that the workers' heartbeats do not show (`Ledger`)."""

    used: Mapping[str, Demand]
    labels: Mapping[str, list[Mapping[str, str]]]
    shares: Mapping[str, list[MLRequirements]]
    jobs: Mapping[str, int]


def _worker_state(
    name: str,
    entry: Mapping[str, Any],
    caps: Capabilities,
    running: list[RunningJob],
    late: list[RunningJob],
    inflight: _Inflight,
) -> WorkerState:
    """One live worker as the core sees it; `late`: jobs started under a grant that its
    heartbeat does not show yet (`_lease_jobs`)."""
    counts = (entry.get("free") or {}).get("free") or {}
    take = Demand.total([inflight.used.get(name, Demand()), *(j.demand for j in late)])
    milli = gpu_free_milli(entry, take.gpus, caps, inflight.shares.get(name, ()))
    gpus = max(0, int(counts.get("gpu_count") or 0) - take.gpus)
    free = FreeCapacity(
        gpus=gpus if milli is None else min(gpus, len(untouched(milli))),
        cpu_cores=max(0.0, float(counts.get("cpu_cores") or 0) - float(take.cpu_cores)),
        memory_gb=max(0.0, float(counts.get("memory_gb") or 0) - float(take.memory_gb)),
        tpu_chips=(counts.get("tpu_chip_count") or None),
        processes=processes_free(entry, inflight.jobs.get(name, 0) + len(late)),
        running_labels=(
            *(r.labels for r in running if r.labels),
            *inflight.labels.get(name, ()),
        ),
    )
    queues = (entry.get("info") or {}).get("queues")
    return WorkerState(
        name,
        caps,
        free,
        frozenset(queues) if queues else frozenset({"celery"}),
        tuple(running),
        gpu_free_milli=milli,
        nvlink_free=nvlink_free(entry, free.gpus, sum(j.gpus for j in late)),
    )


def processes_free(entry: Mapping[str, Any], inflight: int) -> int | None:
    """A worker's pool processes free for another job: its pool's (`info.processes`),
    less the jobs it reported allocated and the `inflight` ones assigned since; None
    where it does not report its pool. Negative: that many jobs wait in its pool's
    queue for a process (the gate hands a job to the pool once its devices are free).
    Plain Celery tasks running there (`info.plain_running`, as of its last heartbeat or
    release) hold processes too."""
    info = entry.get("info") or {}
    limit = info.get("processes")
    if not is_int(limit) or limit < 1:
        return None
    plain = info.get("plain_running")
    busy = len((entry.get("free") or {}).get("allocations") or [])
    return limit - busy - inflight - (plain if _count(plain) else 0)


def _positive(value: Any) -> TypeGuard[float]:
    """Whether a stored value is a positive number of seconds (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _count(value: Any) -> TypeGuard[int]:
    """Whether a heartbeat value is a count: an int (not a bool), at least 0."""
    return is_int(value) and value >= 0


def nvlink_free(entry: Mapping[str, Any], gpus: int | None, taken: int = 0) -> int | None:
    """The most free devices of a worker that are all NVLink peers, as it reported them,
    less the GPUs of jobs it started since (`taken`: they may have come out of that
    set), at most its free GPUs less what was assigned since (`gpus`); None when not
    reported."""
    found = (entry.get("free") or {}).get("nvlink_free")
    if isinstance(found, bool) or not isinstance(found, int) or found < 0:
        return None
    found = max(0, found - taken)
    return found if gpus is None else min(found, gpus)


def _lease_jobs(
    leases: list[dict[str, Any]],
    live: Mapping[str, Mapping[str, Any]],
    shown: Mapping[str, frozenset[str]],
    parse: Parse,
    checkpoints: Mapping[str, float],
    memos: tuple[RunningMemo, JobsMemo],
) -> tuple[dict[str, list[RunningJob]], dict[str, list[RunningJob]]]:
    """The running jobs of each worker, from the leases; and, apart, those started under
    a grant since its last heartbeat (`unseen`): no assignment of the scheduler's counts
    them (the `Ledger` holds only its own), so the capacity the heartbeat shows free is
    theirs until the next one shows them. Kept per worker while nothing they are made
    from changed (`fleet_memo.JobsMemo`)."""
    mine: dict[str, list[dict[str, Any]]] = {}
    for lease in leases:
        mine.setdefault(str(lease.get("worker")), []).append(lease)
    running: dict[str, list[RunningJob]] = {}
    unseen: dict[str, list[RunningJob]] = {}
    jobs, kept = memos
    # A worker's leases are parsed only when its jobs are made again: the others' stay
    # kept, or each heartbeat's refresh would have them all parsed again.
    jobs.keep(str(lease.get("task_id")) for lease in leases)
    for worker, held in mine.items():
        entry = live.get(worker) or {}
        marks = tuple(checkpoints.get(str(x.get("task_id"))) for x in held) if checkpoints else ()
        source = (tuple(held), entry.get("free"), entry.get("ts"), marks)
        make = partial(_worker_jobs, held, live, shown, parse, checkpoints, jobs)
        run, late = kept.jobs(worker, source, make)
        if run:
            running[worker] = run
        if late:
            unseen[worker] = late
    return running, unseen


def _worker_jobs(
    held: list[dict[str, Any]],
    live: Mapping[str, Mapping[str, Any]],
    shown: Mapping[str, frozenset[str]],
    parse: Parse,
    checkpoints: Mapping[str, float],
    memo: RunningMemo,
) -> tuple[list[RunningJob], list[RunningJob]]:
    """One worker's part of `_lease_jobs`, over its leases `held`."""
    running: list[RunningJob] = []
    unseen: list[RunningJob] = []
    for lease in held:
        at = checkpoints.get(str(lease.get("task_id")))
        job = memo.running(lease, at, partial(_running, lease, parse, at))
        if job is None:
            continue
        hidden = _unshown(lease, live, shown)
        if hidden and _started_before(lease, live[str(lease.get("worker"))]):
            job = dataclasses.replace(job, ended=True)
        elif hidden and (lease.get("headers") or {}).get(h.GRANT):
            unseen.append(job)
        running.append(job)
    return running, unseen


def gpu_free_milli(
    entry: Mapping[str, Any], whole: int, caps: Capabilities, shares: Sequence[MLRequirements]
) -> tuple[int, ...] | None:
    """A sharing worker's reported milli-GPU per device, less what was assigned since.

    In-flight jobs are placed as the gate would (`allocator.sharing.place`): `whole`
    GPUs on untouched devices, each share by best fit; one that no longer fits is
    left to the gate, which gives it back. None when the worker does not share.
    """
    found = (entry.get("free") or {}).get("gpu_free_milli")
    if not isinstance(found, list) or len(found) != caps.gpu_count:
        return None
    free = tuple(int(m) for m in found)
    asks = [(whole, FULL)] if whole > 0 else []
    asks += [(1, m) for m in (share_milli(r, caps) for r in shares) if m is not None]
    for count, milli in asks:
        devices = place(free, count, milli)
        if devices is not None:
            free = after(free, devices, milli)
    return free


def allocated_ids(
    live: Mapping[str, Mapping[str, Any]], kept: dict[str, tuple[Any, frozenset[str]]] | None = None
) -> dict[str, frozenset[str]]:
    """Task ids each worker's last heartbeat shows allocated (running or starting).

    `kept`: worker -> (snapshot, ids) of the last call, updated: a snapshot the change
    feed handed back unchanged (the same object) keeps its ids."""
    out: dict[str, frozenset[str]] = {}
    for name, entry in live.items():
        free = entry.get("free") or {}
        hit = None if kept is None else kept.get(name)
        if hit is not None and hit[0] is free:
            out[name] = hit[1]
            continue
        out[name] = frozenset(str(a.get("task_id")) for a in free.get("allocations") or [])
        if kept is not None:
            kept[name] = (free, out[name])
    if kept is not None and len(kept) > len(out):
        for name in kept.keys() - out.keys():
            del kept[name]
    return out


_ENDED_AFTER_S = 0.05
"""A heartbeat taken this long after a job's start shows it allocated if it still runs
(the snapshot is taken just before the heartbeat's timestamp)."""


def _unshown(
    lease: Mapping[str, Any],
    live: Mapping[str, Mapping[str, Any]],
    shown: Mapping[str, frozenset[str]],
) -> bool:
    """Whether a lease's job is missing from its worker's last snapshot (False where there
    is no snapshot to tell)."""
    worker = str(lease.get("worker"))
    entry = live.get(worker)
    if entry is None or "allocations" not in (entry.get("free") or {}):
        return False
    return str(lease.get("task_id")) not in shown.get(worker, frozenset())


def _started_before(lease: Mapping[str, Any], entry: Mapping[str, Any]) -> bool:
    """Whether the worker's last snapshot was taken well after the lease's job started: a
    job it does not show then has ended though its lease is still there. The worker
    writes a release with its next lease batch (`lease_writer`), after the release's
    wake-up: counted in its queue's holdings, the job made its queue look past its fair
    share to the pass that wake-up started (seen in CI). It is kept as running
    otherwise (`RunningJob.ended`): dropped, a worker of short jobs looked idle to
    prefetch (`_room`) and `bench/inference.py` lost 0.03-0.06. A job missing from a
    snapshot taken before it started began since: under a grant, the scheduler counts
    it from its lease (`_lease_jobs`)."""
    started = float(lease.get("started_at") or 0.0)
    return float(entry.get("ts") or 0.0) > started + _ENDED_AFTER_S


def _running(
    lease: Mapping[str, Any], parse: Parse, checkpoint_at: float | None
) -> RunningJob | None:
    headers = lease.get("headers") or {}
    req = parse(headers)
    if req is None:
        return None
    milli = lease.get("gpu_milli")
    share = isinstance(milli, int) and milli > 0
    extra: dict[str, Any] = {
        "gpus": 0 if share else len(lease.get("devices") or []),
        "gpu_milli": milli if share else 0,
        "labels": job_labels(lease.get("name"), headers),
    }
    queue = headers.get(h.LOGICAL)
    if isinstance(queue, str) and queue:
        extra["queue"] = queue
    if checkpoint_at is not None:
        extra["last_checkpoint_at"] = checkpoint_at
    limit = lease.get("time_limit_s")  # the hard limit the worker enforces (Celery's)
    if req.ext_ml_timeout_seconds is None and _positive(limit):
        extra["time_limit_s"] = float(limit)
    policy = headers.get("ext_mlx_scheduling_preemption_policy")
    if isinstance(policy, str):
        extra["preemption_policy"] = policy
    return RunningJob.of(
        str(lease.get("task_id")), req, float(lease.get("started_at") or 0.0), **extra
    )
