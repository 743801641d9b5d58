"""The running half of `Allocator`: the jobs that run, what they leave free, what fits.

`RunningBook` holds a worker's running jobs, its totals and its reservations;
it answers what is free (for matching and the subscription), whether a request
fits now (`assess`) and which devices a job would take. `Allocator`
(`allocator.core`) owns one and adds the hold queue, commits and preemption.

Key decision: free capacity is recomputed from the running jobs, never kept as
a running total, so floats do not drift; the answer with nothing released is
remembered per capacity shape (each job's `RunningJob.shape`), so a worker
cycling through alike jobs sums only once.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from celery_ojs_ml.allocator.choice import choose_whole, linked, share_want, wants_peers
from celery_ojs_ml.allocator.device_kinds import (
    kind_reasons,
    masked,
    roomier,
    same_kind,
    unusable,
)
from celery_ojs_ml.allocator.devices import Peers, largest_peer_set
from celery_ojs_ml.allocator.model import (
    RESOURCE_NAMES,
    Allocation,
    AllocatorError,
    Demand,
    Pending,
)
from celery_ojs_ml.allocator.policy import blocker, counted_reasons, peer_reasons
from celery_ojs_ml.allocator.pools import general_free, pool_free, pool_of
from celery_ojs_ml.allocator.sharing import (
    ShareLedger,
    device_free,
    share_device,
    share_milli,
    share_reasons,
    untouched,
)
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import FreeCapacity, Reason, Verdict
from celery_ojs_ml.matching.match import hard_reasons
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share

_COUNTED = frozenset(RESOURCE_NAMES.values())
ASSESSED_MAX = 1024
"""Memoised (request, capacity shape) verdicts kept before the memo is reset."""


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A running allocation, with the labels and the pool it runs under."""

    alloc: Allocation
    labels: Mapping[str, str]
    pool: str | None = None
    """The dynamic reservation (§8.3) it runs inside, if any (`allocator.pools`)."""
    shape: tuple[Any, ...] = field(init=False)
    """What `Allocator.capacity_key` knows of this job (computed once, at commit)."""

    def __post_init__(self) -> None:
        a = self.alloc
        shape = (
            a.band,
            a.preemptible,
            len(a.devices),
            a.cpu_cores,
            a.memory_gb,
            a.tpu_chips,
            tuple(sorted(self.labels.items())),
            self.pool,
            (a.devices, a.gpu_milli) if a.gpu_milli else None,  # a share: which device, how much
        )
        object.__setattr__(self, "shape", shape)  # frozen: set once, here


@dataclass(frozen=True, slots=True)
class Assessment:
    """A request judged against what is free: the verdict, its reasons, and them in words."""

    verdict: Verdict
    reasons: tuple[Reason, ...]
    why: str


class RunningBook:
    """Running jobs, totals and reservations of one worker, and what they leave free."""

    def __init__(
        self,
        caps: Capabilities,
        *,
        reserve_cpu: float,
        reserve_memory_gb: float,
        gpu_sharing: bool,
        nvlink_peers: Peers | None,
    ) -> None:
        self._caps = caps
        self._peers = nvlink_peers
        """NVLink peers per device (`allocator.devices.Peers`); None: not known, any set."""
        self._most_linked = (
            largest_peer_set(range(caps.gpu_count), nvlink_peers) if nvlink_peers else 0
        )
        """The largest set of devices that are all peers (fixed for the worker's life)."""
        self._ledger = ShareLedger(caps.gpu_count) if gpu_sharing else None
        """Milli-GPU per device (`allocator.sharing`); None: sharing off, whole GPUs only."""
        self._total = Demand.capacity(caps, reserve_cpu, reserve_memory_gb)
        self._running: dict[Hashable, RunningJob] = {}
        self._shape: frozenset[tuple[tuple[Any, ...], int]] | None = None
        self._shapes: dict[tuple[Any, ...], int] = {}
        """How many running jobs have each `RunningJob.shape` (kept as jobs start and end)."""
        self._free_now: Demand | None = None
        self._free_by_shape: dict[Hashable, Demand] = {}
        """Caches of `capacity_key` and `free_after(())`, dropped whenever `_running` changes."""
        self._pools: dict[str, Demand] = {}
        """Dynamic reservations held here: id -> the capacity carved out for it (§8.3)."""
        self._assessed: dict[tuple[int, Hashable], tuple[MLRequirements, Assessment]] = {}
        """Memo of `_assess_now`: (request id, capacity shape) -> the request and its verdict."""

    @property
    def pools(self) -> Mapping[str, Demand]:
        """The reservations held here and their sizes."""
        return dict(self._pools)

    @property
    def total(self) -> Demand:
        """The worker's counted capacity, less its reserves."""
        return self._total

    @property
    def sharing(self) -> bool:
        """Whether GPUs are shared in milli-GPU (`allocator.sharing`)."""
        return self._ledger is not None

    def set_pools(self, pools: Mapping[str, Demand]) -> None:
        """Hold exactly these reservations (`allocator.pools`); others end here."""
        if dict(pools) != self._pools:
            self._pools = dict(pools)
            self._shape = self._free_now = None
            self._assessed.clear()
            self._free_by_shape.clear()

    def get(self, key: Hashable) -> RunningJob | None:
        """The running job of `key`, or None."""
        return self._running.get(key)

    def jobs(self) -> Mapping[Hashable, RunningJob]:
        """Every running job by key (a live view: read it, do not keep it)."""
        return self._running

    def add(self, key: Hashable, job: RunningJob) -> None:
        """A job starts: its devices (and milli-GPU) are taken."""
        if self._ledger is not None:  # refuses to oversubscribe a device (invariant 1)
            self._ledger.take_job(key, job.alloc.devices, job.alloc.gpu_milli)
        self._running[key] = job
        self._shapes[job.shape] = self._shapes.get(job.shape, 0) + 1
        self._shape = self._free_now = None

    def remove(self, key: Hashable) -> RunningJob | None:
        """A job ends: what it held is free again; None if it was not running."""
        job = self._running.pop(key, None)
        if job is None:
            return None
        if self._ledger is not None:
            self._ledger.release_job(key, job.alloc.devices)
        left = self._shapes[job.shape] - 1
        if left:
            self._shapes[job.shape] = left
        else:
            del self._shapes[job.shape]
        self._shape = self._free_now = None
        return job

    def may_trade(self, job: RunningJob, devices: Sequence[int]) -> bool:
        """Whether a job may run on `devices` instead: as many, whole, as linked as before."""
        old = job.alloc.devices
        if len(devices) != len(old) or job.alloc.gpu_milli:
            return False  # a share stays where its milli-GPU are accounted
        if not same_kind(self._caps, old, devices):  # a mixed or MIG host: device_kinds
            return False
        peers = self._peers
        return peers is None or len(old) < 2 or not linked(old, peers) or linked(devices, peers)

    def repin(self, pairs: Sequence[tuple[Hashable, Sequence[int]]]) -> list[Allocation]:
        """Give running (whole-GPU) jobs other devices, all at once; their new allocations.

        Every job's devices are released before any is taken again, so two jobs may
        exchange theirs. The count of each shape is unchanged (a shape names no device).
        """
        jobs = [(key, self._running[key]) for key, _ in pairs]
        if self._ledger is not None:
            for key, job in jobs:
                self._ledger.release_job(key, job.alloc.devices)
        out = []
        for (key, job), (_, devices) in zip(jobs, pairs, strict=True):
            alloc = replace(job.alloc, devices=tuple(devices))
            if self._ledger is not None:
                self._ledger.take_job(key, alloc.devices, 0)
            self._running[key] = RunningJob(alloc, job.labels, job.pool)
            out.append(alloc)
        return out

    def devices_for(
        self, req: MLRequirements, want: Demand, prefer: Sequence[Sequence[int]]
    ) -> tuple[tuple[int, ...], int]:
        """The devices a job takes (`allocator.choice`) and its milli (0: whole GPUs)."""
        milli = share_milli(req, self._caps) if self._ledger is not None else None
        if milli is not None:
            free = masked(self.gpu_free_milli(), req, self._caps)  # a mixed host: device_kinds
            return (share_device(free, milli, prefer),), milli
        peers = self._peers if wants_peers(req, self._peers) else None
        taken = self.taken(()) | unusable(req, self._caps)  # a mixed or MIG host: device_kinds
        taken |= roomier(req, self._caps, taken)
        found = choose_whole(self._caps.gpu_count, taken, want.gpus, prefer, peers)
        if found is None:
            raise AllocatorError(f"no {want.gpus} GPUs that are NVLink peers are free")
        return found, 0

    def free_capacity(self) -> FreeCapacity:
        """What is free now, for matching and the subscription."""
        return self.capacity_view(())

    def allocations(self) -> list[Allocation]:
        """Running allocations, oldest first."""
        return [job.alloc for job in self._running.values()]

    def gpu_free_milli(self, released: Collection[Allocation] = ()) -> tuple[int, ...]:
        """Milli-GPU left on each device (0 where a whole job holds it), `released` gone."""
        gone = {a.key for a in released}
        held = (
            (j.alloc.devices, j.alloc.gpu_milli) for k, j in self._running.items() if k not in gone
        )
        return device_free(self._caps.gpu_count, held)

    def shape_now(self) -> frozenset[tuple[tuple[Any, ...], int]]:
        """The running jobs' part of `capacity_key`: each job shape with its count."""
        if self._shape is None:
            self._shape = frozenset(self._shapes.items())
        return self._shape

    def free_after(self, released: Collection[Allocation]) -> Demand:
        """Free counted resources, `released` gone; a device a share touches is not a free GPU."""
        free = self._free_counted(released)
        if self._ledger is None or not any(j.alloc.gpu_milli for j in self._running.values()):
            return free
        return replace(free, gpus=min(free.gpus, len(untouched(self.gpu_free_milli(released)))))

    def _free_counted(self, released: Collection[Allocation]) -> Demand:
        """Free counted resources once `released` are gone (recomputed, so no float drift).

        With nothing released, the answer is a function of the capacity shape
        (`capacity_key` names each running job's counted demand), so it is
        remembered per shape: a worker cycling through alike jobs sums only once.
        """
        if self._pools:
            return self.free_in(None, released)
        if not released:
            if self._free_now is None:
                shape = self.shape_now()
                free = self._free_by_shape.get(shape)
                if free is None:
                    if len(self._free_by_shape) >= ASSESSED_MAX:
                        self._free_by_shape.clear()
                    free = self._free_by_shape[shape] = self._total.minus(
                        Demand.total(j.alloc.demand for j in self._running.values())
                    )
                self._free_now = free
            return self._free_now
        gone = {a.key for a in released}
        used = Demand.total(j.alloc.demand for k, j in self._running.items() if k not in gone)
        return self._total.minus(used)

    def free_in(self, pool: str | None, released: Collection[Allocation]) -> Demand:
        """Free for a job inside `pool` (None: outside every pool), `released` gone."""
        gone = {a.key for a in released}
        uses = [(j.pool, j.alloc.demand) for k, j in self._running.items() if k not in gone]
        if pool is None:
            return general_free(self._total, uses, self._pools)
        return pool_free(pool, uses, self._pools)

    def capacity_view(self, released: Collection[Allocation]) -> FreeCapacity:
        free, gone = self.free_after(released), {a.key for a in released}
        return FreeCapacity(
            gpus=free.gpus,
            cpu_cores=free.cpu_cores,
            memory_gb=free.memory_gb,
            tpu_chips=free.tpu_chips if self._caps.tpu else None,
            running_labels=tuple(
                j.labels for k, j in self._running.items() if j.labels and k not in gone
            ),
            reservations=frozenset(self._pools),
        )

    def assess(
        self, req: MLRequirements, ahead: Sequence[Pending], released: Collection[Allocation] = ()
    ) -> Assessment:
        """FITS / WAIT / NEVER with reasons; counted resources are judged here (reserves)."""
        pool = pool_of(req.ext_ml_reservation_id, self._pools)
        free = self.free_in(pool, released) if pool else self.free_after(released)
        total = self._pools[pool] if pool else self._total
        found = hard_reasons(req, self._caps, self.capacity_view(released))
        reasons = [r for r in found if r.resource not in _COUNTED]
        want = Demand.of(req)
        if gpu_share(req) is not None:
            milli = masked(self.gpu_free_milli(released), req, self._caps)
            reasons += share_reasons(req, self._caps, self._ledger is not None, milli)
            want = share_want(req, self._caps, want, milli)
        else:  # a mixed or MIG host: the devices of the job's kind (`device_kinds`)
            reasons += kind_reasons(req, self._caps, want.gpus, self.taken(released))
        reasons += counted_reasons(want, total, free)
        if not reasons and self._peers is not None and wants_peers(req, self._peers):
            taken = self.taken(released) | unusable(req, self._caps)
            count, most = self._caps.gpu_count, self._most_linked
            reasons += peer_reasons(want.gpus, self._peers, count, taken, most)
        never = tuple(r for r in reasons if r.verdict is Verdict.NEVER)
        if never:
            return Assessment(Verdict.NEVER, never, _join(never))
        if reasons:
            return Assessment(Verdict.WAIT, tuple(reasons), _join(reasons))
        # Only held requests that draw on the same capacity can be delayed by this one:
        # a reservation's pool and the rest of the worker are disjoint (§8.3).
        rivals = [p for p in ahead if pool_of(p.req.ext_ml_reservation_id, self._pools) == pool]
        why = blocker(want, free, rivals)
        return Assessment(Verdict.WAIT, (), why) if why else Assessment(Verdict.FITS, (), "")

    def assess_now(self, req: MLRequirements) -> Assessment:
        """`assess(req, ())`, memoised on the request and the capacity shape.

        With nothing held ahead the answer depends only on the request, the
        worker's totals and the running jobs' shapes, so a worker starting
        alike jobs matches each (request, shape) once. The cache keeps the
        request object alive, so its `id` cannot be reused while cached.
        """
        if self._pools or wants_peers(req, self._peers) or self._caps.gpu_devices:
            return self.assess(req, ())  # device sets matter, not counts alone
        key = (id(req), self.shape_now())
        hit = self._assessed.get(key)
        if hit is not None and hit[0] is req:
            return hit[1]
        seen = self.assess(req, ())
        if len(self._assessed) >= ASSESSED_MAX:
            self._assessed.clear()
        self._assessed[key] = (req, seen)
        return seen

    def assess_behind(self, req: MLRequirements, ahead: Sequence[Pending]) -> Assessment:
        """`assess(req, ahead)`: the memoised verdict against what is free (`_assess_now`),
        then the backfill rule against the held requests `ahead` when that verdict fits.
        The reasons never depend on `ahead`; only whether a fitting request must wait."""
        if not ahead:
            return self.assess_now(req)
        if self._pools or gpu_share(req) is not None or wants_peers(req, self._peers):
            return self.assess(req, ahead)
        if self._caps.gpu_devices:
            return self.assess(req, ahead)
        seen = self.assess_now(req)
        if seen.verdict is not Verdict.FITS:
            return seen
        why = blocker(Demand.of(req), self.free_after(()), ahead)  # no pools: every one a rival
        return Assessment(Verdict.WAIT, (), why) if why else seen

    def taken(self, released: Collection[Allocation]) -> set[int]:
        gone = {a.key for a in released}
        return {i for a in self.allocations() if a.key not in gone for i in a.devices}


def _join(reasons: Sequence[Reason]) -> str:
    return ", ".join(r.message for r in reasons)
