"""The per-worker allocation state machine after Flux RFC 27.

One `Allocator` owns a worker's counted resources and GPU indices. It answers
`try_alloc` with an `Allocation` (SUCCESS), a `Pending` carrying the pending
reason (ANNOTATE) or `Denied` (DENY); it also frees, cancels and re-prioritises
held requests, pumps the hold queue, and picks preemption victims.

Key decision: it is pure. No Celery, no I/O, no threads and an injected clock,
so the worker's gate (which calls it from the main process only) owns all
concurrency, and every rule here is tested without a broker. Verdicts reuse
matching's filters and reason strings, so the worker says what `match` says.
With GPU sharing on, a `ShareLedger` accounts each device in milli-GPU
(`allocator.sharing`): shares fill partly used devices, whole jobs take only
untouched ones, and a device a share touches is not a free GPU.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from celery_ojs_ml.allocator.choice import choose_whole, share_want, wants_peers
from celery_ojs_ml.allocator.devices import Peers, largest_peer_set
from celery_ojs_ml.allocator.model import (
    RESOURCE_NAMES,
    Allocation,
    AllocatorError,
    Demand,
    Denied,
    Pending,
    preemptible_of,
    rank,
)
from celery_ojs_ml.allocator.policy import (
    blocker,
    choose_victims,
    counted_reasons,
    is_victim,
    peer_reasons,
)
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
from celery_ojs_ml.spec.classes import band as band_of
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share

_COUNTED = frozenset(RESOURCE_NAMES.values())
_ASSESSED_MAX = 1024
"""Memoised (request, capacity shape) verdicts kept before the memo is reset."""


@dataclass(frozen=True, slots=True)
class _Job:
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
class _Assessment:
    verdict: Verdict
    reasons: tuple[Reason, ...]
    why: str


class Allocator:
    """Devices, counted resources and the hold queue of one worker (see module doc)."""

    def __init__(
        self,
        caps: Capabilities,
        *,
        clock: Callable[[], float] = time.monotonic,
        reserve_cpu: float = 0,
        reserve_memory_gb: float = 0,
        allow_on_demand_preemption: bool = False,
        gpu_sharing: bool = False,
        nvlink_peers: Peers | None = None,
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
        self._clock = clock
        self._total = Demand.capacity(caps, reserve_cpu, reserve_memory_gb)
        self._allow_on_demand = allow_on_demand_preemption
        self._running: dict[Hashable, _Job] = {}
        self._held: dict[Hashable, Pending] = {}
        self._seq: dict[Hashable, int] = {}
        self._counter = itertools.count()
        self._shape: frozenset[tuple[tuple[Any, ...], int]] | None = None
        self._shapes: dict[tuple[Any, ...], int] = {}
        """How many running jobs have each `_Job.shape` (kept as jobs start and end)."""
        self._free_now: Demand | None = None
        self._assessed: dict[tuple[int, Hashable], tuple[MLRequirements, _Assessment]] = {}
        self._free_by_shape: dict[Hashable, Demand] = {}
        """Caches of `capacity_key` and `_free(())`, dropped whenever `_running` changes."""
        self._pools: dict[str, Demand] = {}
        """Dynamic reservations held here: id -> the capacity carved out for it (§8.3)."""

    def set_pools(self, pools: Mapping[str, Demand]) -> None:
        """Hold exactly these reservations (`allocator.pools`); others end here."""
        if dict(pools) != self._pools:
            self._pools = dict(pools)
            self._shape = self._free_now = None
            self._assessed.clear()
            self._free_by_shape.clear()

    @property
    def pools(self) -> Mapping[str, Demand]:
        """The reservations held here and their sizes."""
        return dict(self._pools)

    def try_alloc(
        self,
        key: Hashable,
        task_id: str,
        req: MLRequirements,
        *,
        priority: int = 0,
        labels: Mapping[str, str] | None = None,
        prefer: Sequence[Sequence[int]] = (),
    ) -> Allocation | Pending | Denied:
        """RFC 27 alloc: SUCCESS now, a `Pending` to `hold` (WAIT), or DENY (NEVER).

        A request that fits still waits when it would take resources that a held
        request ranked ahead of it is waiting for (the backfill rule in `policy`).
        `prefer`: device sets to take when one is free and of the right size (the
        sets warm pool children are bound to), before the best fit.
        """
        self._check_new(key)
        band, now = band_of(req), self._clock()
        mine = (-rank(band), -priority, now)
        ahead = [p for p in self.held() if self._order(p)[:3] <= mine] if self._held else []
        seen = self._assess(req, ahead) if ahead else self._assess_now(req)
        if seen.verdict is Verdict.NEVER:
            return Denied(key, task_id, seen.why, seen.reasons)
        if seen.verdict is Verdict.WAIT:
            return Pending(key, task_id, req, band, priority, now, seen.why, dict(labels or {}))
        return self._commit(key, task_id, req, band, labels or {}, prefer)

    def hold(self, pending: Pending) -> None:
        """Queue a request by band, then priority (higher first), then FIFO by `since`."""
        self._check_new(pending.key)
        seen = self._assess(pending.req, ())
        if seen.verdict is Verdict.NEVER:
            raise AllocatorError(
                f"task {pending.task_id} can never run on this worker ({seen.why}); "
                "deny it (try_alloc returns Denied) instead of holding it"
            )
        self._held[pending.key] = pending
        self._seq[pending.key] = next(self._counter)

    def free(self, key: Hashable) -> Allocation | None:
        """RFC 27 free: release a running job's resources; None if it holds none."""
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
        return job.alloc

    def move(self, key: Hashable, devices: Sequence[int]) -> Allocation | None:
        """Give a running job other devices of the same count, if all are free; else None.

        The warm pool moves a job to the devices an idle child is bound to.
        """
        job = self._running.get(key)
        if job is None or len(devices) != len(job.alloc.devices) or job.alloc.gpu_milli:
            return None  # a share stays where its milli-GPU are accounted
        taken = {i for k, j in self._running.items() if k != key for i in j.alloc.devices}
        if set(devices) & taken or not all(0 <= i < self._caps.gpu_count for i in devices):
            return None
        alloc = replace(job.alloc, devices=tuple(devices))
        if self._ledger is not None:
            self._ledger.release_job(key, job.alloc.devices)
            self._ledger.take_job(key, alloc.devices, 0)
        self._running[key] = _Job(alloc, job.labels, job.pool)
        return alloc

    def cancel(self, key: Hashable) -> Pending | None:
        """RFC 27 cancel: drop a held request (revoked, expired); None if not held."""
        self._seq.pop(key, None)
        return self._held.pop(key, None)

    def prioritise(self, key: Hashable, priority: int) -> Pending | None:
        """RFC 27 prioritize: change a held request's priority; unknown keys are ignored."""
        pending = self._held.get(key)
        if pending is not None:
            pending.priority = priority
        return pending

    def pump(self) -> list[Allocation]:
        """Start held requests that fit now, in queue order, under the backfill rule.

        Requests that still wait get a fresh pending reason (RFC 27 ANNOTATE).
        """
        started: list[Allocation] = []
        ahead: list[Pending] = []
        for pending in self.held():
            seen = self._assess(pending.req, ahead)
            if seen.verdict is Verdict.FITS:
                self.cancel(pending.key)
                started.append(self._start(pending))
            else:
                pending.reason = seen.why
                ahead.append(pending)
        return started

    def expired(self, max_hold_s: float) -> list[Pending]:
        """Remove and return requests held longer than `max_hold_s` (the worker requeues them)."""
        now = self._clock()
        out = [p for p in self.held() if now - p.since > max_hold_s]
        for pending in out:
            self.cancel(pending.key)
        return out

    def capacity_key(self) -> Hashable:
        """What `free_capacity`, `preemptible_capacity` and `held() != []` depend on.

        Equal keys mean equal answers, so callers may cache what they derive.
        It names the running jobs by what those answers depend on (band,
        preemptibility, counted demand, labels), not by identity, so a worker
        that keeps starting and finishing alike jobs sees only a few keys and a
        cache keyed on it (the subscription) stays hot.
        """
        return self._shape_now(), bool(self._held)

    def _shape_now(self) -> frozenset[tuple[tuple[Any, ...], int]]:
        """The running jobs' part of `capacity_key`: each job shape with its count."""
        if self._shape is None:
            self._shape = frozenset(self._shapes.items())
        return self._shape

    def free_capacity(self) -> FreeCapacity:
        """What is free now, for matching and the subscription."""
        return self._capacity_view(())

    def preemptible_capacity(self, above_band: str) -> FreeCapacity:
        """Free capacity plus what `above_band` may preempt (same rule as `victims`)."""
        return self._capacity_view(self._candidates(above_band))

    def victims(self, req: MLRequirements, band: str) -> list[Allocation] | None:
        """A minimal set of jobs to preempt so that `req` fits ([] if it fits now).

        None when the request can never run here or no allowed set makes room.
        The policy (lowest band, newest first, then pruning) is in `policy`.
        """
        if self._assess(req, ()).verdict is Verdict.NEVER:
            return None

        def fits(released: Sequence[Allocation]) -> bool:
            return self._assess(req, (), released).verdict is Verdict.FITS

        return choose_victims(self._candidates(band), fits)

    def allocations(self) -> list[Allocation]:
        """Running allocations, oldest first."""
        return [job.alloc for job in self._running.values()]

    def held(self) -> list[Pending]:
        """Held requests in queue order: the order `pump` serves them in."""
        return sorted(self._held.values(), key=self._order)

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for `celery inspect stats`, Flower and `celery ojs-ml status`."""
        owners = {i: a.task_id for a in self.allocations() for i in a.devices}
        snap = {
            "capacity": _counts(self._total),
            "free": _counts(self._free(())),
            "devices": {str(i): owners.get(i) for i in range(self._caps.gpu_count)},
            "allocations": [a.as_dict() for a in self.allocations()],
            "held": [p.as_dict() for p in self.held()],
        }
        if self._pools:  # only while any is held: the heartbeat stays as small as before
            snap["reservations"] = {rid: _counts(d) for rid, d in self._pools.items()}
        if self._ledger is not None:  # sharing on: the scheduler's per-device fit reads it
            snap["gpu_free_milli"] = list(self.gpu_free_milli())
        if self._peers is not None:  # the scheduler places NVLink jobs on free islands
            free = set(range(self._caps.gpu_count)) - self._taken(())
            snap["nvlink_free"] = largest_peer_set(free, self._peers)
        return snap

    def gpu_free_milli(self, released: Collection[Allocation] = ()) -> tuple[int, ...]:
        """Milli-GPU left on each device (0 where a whole job holds it), `released` gone."""
        gone = {a.key for a in released}
        held = (
            (j.alloc.devices, j.alloc.gpu_milli) for k, j in self._running.items() if k not in gone
        )
        return device_free(self._caps.gpu_count, held)

    def _check_new(self, key: Hashable) -> None:
        if key in self._running or key in self._held:
            state = "running" if key in self._running else "held"
            raise AllocatorError(
                f"key {key!r} is already {state}; free() or cancel() it before allocating "
                "again (RFC 27: one alloc request per job)"
            )

    def _order(self, p: Pending) -> tuple[int, int, float, int]:
        return (-rank(p.band), -p.priority, p.since, self._seq.get(p.key, -1))

    def _candidates(self, band: str) -> list[Allocation]:
        allow = self._allow_on_demand
        return [a for a in self.allocations() if is_victim(a, band, allow_on_demand=allow)]

    def _free(self, released: Collection[Allocation]) -> Demand:
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
            return self._free_in(None, released)
        if not released:
            if self._free_now is None:
                shape = self._shape_now()
                free = self._free_by_shape.get(shape)
                if free is None:
                    if len(self._free_by_shape) >= _ASSESSED_MAX:
                        self._free_by_shape.clear()
                    free = self._free_by_shape[shape] = self._total.minus(
                        Demand.total(j.alloc.demand for j in self._running.values())
                    )
                self._free_now = free
            return self._free_now
        gone = {a.key for a in released}
        used = Demand.total(j.alloc.demand for k, j in self._running.items() if k not in gone)
        return self._total.minus(used)

    def _free_in(self, pool: str | None, released: Collection[Allocation]) -> Demand:
        """Free for a job inside `pool` (None: outside every pool), `released` gone."""
        gone = {a.key for a in released}
        uses = [(j.pool, j.alloc.demand) for k, j in self._running.items() if k not in gone]
        if pool is None:
            return general_free(self._total, uses, self._pools)
        return pool_free(pool, uses, self._pools)

    def _capacity_view(self, released: Collection[Allocation]) -> FreeCapacity:
        free, gone = self._free(released), {a.key for a in released}
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

    def _assess_now(self, req: MLRequirements) -> _Assessment:
        """`_assess(req, ())`, memoised on the request and the capacity shape.

        With nothing held ahead the answer depends only on the request, the
        worker's totals and what `capacity_key` describes, so a worker starting
        alike jobs matches each (request, shape) once. The cache keeps the
        request object alive, so its `id` cannot be reused while cached.
        """
        if self._pools or wants_peers(req, self._peers):  # device sets matter, not counts alone
            return self._assess(req, ())
        key = (id(req), self.capacity_key())
        hit = self._assessed.get(key)
        if hit is not None and hit[0] is req:
            return hit[1]
        seen = self._assess(req, ())
        if len(self._assessed) >= _ASSESSED_MAX:
            self._assessed.clear()
        self._assessed[key] = (req, seen)
        return seen

    def _assess(
        self, req: MLRequirements, ahead: Sequence[Pending], released: Collection[Allocation] = ()
    ) -> _Assessment:
        """FITS / WAIT / NEVER with reasons; counted resources are judged here (reserves)."""
        pool = pool_of(req.ext_ml_reservation_id, self._pools)
        free = self._free_in(pool, released) if pool else self._free(released)
        total = self._pools[pool] if pool else self._total
        found = hard_reasons(req, self._caps, self._capacity_view(released))
        reasons = [r for r in found if r.resource not in _COUNTED]
        want = Demand.of(req)
        if gpu_share(req) is not None:
            milli = self.gpu_free_milli(released)
            reasons += share_reasons(req, self._caps, self._ledger is not None, milli)
            want = share_want(req, self._caps, want, milli)
        reasons += counted_reasons(want, total, free)
        if not reasons and self._peers is not None and wants_peers(req, self._peers):
            taken = self._taken(released)
            count, most = self._caps.gpu_count, self._most_linked
            reasons += peer_reasons(want.gpus, self._peers, count, taken, most)
        never = tuple(r for r in reasons if r.verdict is Verdict.NEVER)
        if never:
            return _Assessment(Verdict.NEVER, never, _join(never))
        if reasons:
            return _Assessment(Verdict.WAIT, tuple(reasons), _join(reasons))
        why = blocker(want, free, ahead)
        return _Assessment(Verdict.WAIT, (), why) if why else _Assessment(Verdict.FITS, (), "")

    def _devices(
        self, req: MLRequirements, want: Demand, prefer: Sequence[Sequence[int]]
    ) -> tuple[tuple[int, ...], int]:
        """The devices a job takes (`allocator.choice`) and its milli (0: whole GPUs)."""
        milli = share_milli(req, self._caps) if self._ledger is not None else None
        if milli is not None:
            return (share_device(self.gpu_free_milli(), milli, prefer),), milli
        peers = self._peers if wants_peers(req, self._peers) else None
        found = choose_whole(self._caps.gpu_count, self._taken(()), want.gpus, prefer, peers)
        if found is None:
            raise AllocatorError(f"no {want.gpus} GPUs that are NVLink peers are free")
        return found, 0

    def _taken(self, released: Collection[Allocation]) -> set[int]:
        gone = {a.key for a in released}
        return {i for a in self.allocations() if a.key not in gone for i in a.devices}

    def _start(self, p: Pending) -> Allocation:
        return self._commit(p.key, p.task_id, p.req, p.band, p.labels)

    def _commit(
        self,
        key: Hashable,
        task_id: str,
        req: MLRequirements,
        band: str,
        labels: Mapping[str, str],
        prefer: Sequence[Sequence[int]] = (),
    ) -> Allocation:
        want = Demand.of(req)
        pool = pool_of(req.ext_ml_reservation_id, self._pools)
        if want.short_of(self._free_in(pool, ()) if pool else self._free(())):
            raise AllocatorError(f"task {task_id} does not fit; refusing to overcommit")
        devices, milli = self._devices(req, want, prefer)
        alloc = Allocation(
            key,
            task_id,
            devices,
            want.cpu_cores,
            want.memory_gb,
            want.tpu_chips,
            band,
            preemptible_of(req),
            self._clock(),
            milli,
        )
        if self._ledger is not None:  # refuses to oversubscribe a device (invariant 1)
            self._ledger.take_job(key, devices, milli)
        job = self._running[key] = _Job(alloc, dict(labels), pool)
        self._shapes[job.shape] = self._shapes.get(job.shape, 0) + 1
        self._shape = self._free_now = None
        return alloc


def _join(reasons: Sequence[Reason]) -> str:
    return ", ".join(r.message for r in reasons)


def _counts(d: Demand) -> dict[str, float]:
    return {RESOURCE_NAMES[name]: amount for name, amount in d.items()}
