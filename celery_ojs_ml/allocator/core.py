"""The per-worker allocation state machine after Flux RFC 27.

One `Allocator` owns a worker's counted resources and GPU indices. It answers
`try_alloc` with an `Allocation` (SUCCESS), a `Pending` carrying the pending
reason (ANNOTATE) or `Denied` (DENY); it also frees, cancels and re-prioritises
held requests, pumps the hold queue, and picks preemption victims.

Key decision: it is pure. No Celery, no I/O, no threads and an injected clock,
so the worker's gate (which calls it from the main process only) owns all
concurrency, and every rule here is tested without a broker. Verdicts reuse
matching's filters and reason strings, so the worker says what `match` says.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Hashable, KeysView, Mapping, Sequence
from typing import Any

from celery_ojs_ml.allocator.capacity import RunningBook, RunningJob
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
from celery_ojs_ml.allocator.policy import choose_victims, is_victim
from celery_ojs_ml.allocator.pools import pool_of
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import FreeCapacity, Verdict
from celery_ojs_ml.spec.classes import band as band_of
from celery_ojs_ml.spec.resources import MLRequirements


class Allocator:
    """Devices, counted resources and the hold queue of one worker (see module doc).

    What runs, and what it leaves free, is kept by the `RunningBook` it owns (`book`,
    `allocator.capacity`). With GPU sharing on, a `ShareLedger` accounts each device in
    milli-GPU (`allocator.sharing`): shares fill partly used devices, whole jobs take
    only untouched ones, and a device a share touches is not a free GPU.
    """

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
        self.book = RunningBook(
            caps,
            reserve_cpu=reserve_cpu,
            reserve_memory_gb=reserve_memory_gb,
            gpu_sharing=gpu_sharing,
            nvlink_peers=nvlink_peers,
        )
        self._caps = caps
        self._peers = nvlink_peers
        self._clock = clock
        self._allow_on_demand = allow_on_demand_preemption
        self._held: dict[Hashable, Pending] = {}
        self._seq: dict[Hashable, int] = {}
        self._counter = itertools.count()

    def set_pools(self, pools: Mapping[str, Demand]) -> None:
        """Hold exactly these reservations (`allocator.pools`); others end here."""
        self.book.set_pools(pools)

    @property
    def pools(self) -> Mapping[str, Demand]:
        """The reservations held here and their sizes."""
        return self.book.pools

    def free_capacity(self) -> FreeCapacity:
        """What is free now, for matching and the subscription."""
        return self.book.free_capacity()

    def allocations(self) -> list[Allocation]:
        """Running allocations, oldest first."""
        return self.book.allocations()

    def gpu_free_milli(self, released: Collection[Allocation] = ()) -> tuple[int, ...]:
        """Milli-GPU left on each device (0 where a whole job holds it), `released` gone."""
        return self.book.gpu_free_milli(released)

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
        seen = self.book.assess_behind(req, ahead)
        if seen.verdict is Verdict.NEVER:
            return Denied(key, task_id, seen.why, seen.reasons)
        if seen.verdict is Verdict.WAIT:
            return Pending(key, task_id, req, band, priority, now, seen.why, dict(labels or {}))
        return self._commit(key, task_id, req, band, labels or {}, prefer)

    def hold(self, pending: Pending) -> None:
        """Queue a request by band, then priority (higher first), then FIFO by `since`."""
        self._check_new(pending.key)
        seen = self.book.assess_now(pending.req)
        if seen.verdict is Verdict.NEVER:
            raise AllocatorError(
                f"task {pending.task_id} can never run on this worker ({seen.why}); "
                "deny it (try_alloc returns Denied) instead of holding it"
            )
        self._held[pending.key] = pending
        self._seq[pending.key] = next(self._counter)

    def free(self, key: Hashable) -> Allocation | None:
        """RFC 27 free: release a running job's resources; None if it holds none."""
        job = self.book.remove(key)
        return None if job is None else job.alloc

    def hand_over(
        self,
        old: Hashable,
        new: Hashable,
        task_id: str,
        req: MLRequirements,
        *,
        labels: Mapping[str, str] | None = None,
    ) -> tuple[Allocation, Allocation] | None:
        """Free `old` and give its devices to `new` at once: the job the warm pool wrote
        to `old`'s child behind it starts there as `old` ends (pipelining), so the
        backfill rule does not apply: it is already on its way. `(freed, taken)`, or
        None when `old` holds nothing or `new` does not fit exactly its devices."""
        job = self.book.get(old)
        if job is None:
            return None
        self._check_new(new)
        freed = job.alloc
        want = Demand.of(req)
        if want.short_of(freed.demand.plus(self.book.free_after(()))):
            return None
        self.book.remove(old)
        taken = self._commit(new, task_id, req, band_of(req), labels or {}, [freed.devices])
        if taken.devices != freed.devices:  # pinned elsewhere: its CUDA is born on these
            taken = self.book.repin([(new, freed.devices)])[0]
        return freed, taken

    def move(self, key: Hashable, devices: Sequence[int]) -> Allocation | None:
        """Give a running job other devices of the same count, if all are free; else None.

        The warm pool moves a job to the devices an idle child is bound to. A set
        of NVLink peers is only exchanged for another one.
        """
        book = self.book
        job = book.get(key)
        if job is None or not book.may_trade(job, devices):
            return None
        taken = {i for k, j in book.jobs().items() if k != key for i in j.alloc.devices}
        if set(devices) & taken or not all(0 <= i < self._caps.gpu_count for i in devices):
            return None
        return book.repin([(key, devices)])[0]

    def swap(self, a: Hashable, b: Hashable) -> tuple[Allocation, Allocation] | None:
        """Exchange the devices of two running jobs of the same count; None if they cannot.

        The warm pool gives a job waiting for a pool child the devices an idle
        child is bound to, when a later job that no child has taken holds them.
        """
        book = self.book
        ja, jb = book.get(a), book.get(b)
        if ja is None or jb is None or a == b:
            return None
        da, db = ja.alloc.devices, jb.alloc.devices
        if not (book.may_trade(ja, db) and book.may_trade(jb, da)):
            return None
        new_a, new_b = book.repin([(a, db), (b, da)])
        return new_a, new_b

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
        waits: dict[int, tuple[MLRequirements, str]] = {}
        for pending in self.held():
            same = waits.get(id(pending.req))
            if same is not None and same[0] is pending.req:
                # An equal request ahead waits: this one does too (capacity only shrinks
                # and `ahead` only grows within a pump), for the same reason.
                pending.reason = same[1]
                ahead.append(pending)
                continue
            seen = self.book.assess_behind(pending.req, ahead)
            if seen.verdict is Verdict.FITS:
                self.cancel(pending.key)
                started.append(self._start(pending))
            else:
                pending.reason = seen.why
                ahead.append(pending)
                waits[id(pending.req)] = (pending.req, seen.why)
        return started

    def expired(self, max_hold_s: float) -> list[Pending]:
        """Remove and return requests held longer than `max_hold_s` (the worker requeues them).

        Each carries the reason it waits for as judged now, as `pump` judges it (the one
        from the last pump or hold may be stale: capacity changes without a pump when a
        job starts). Nothing is assessed when nothing expired (the usual tick)."""
        now = self._clock()
        if all(now - p.since <= max_hold_s for p in self._held.values()):
            return []
        out: list[Pending] = []
        ahead: list[Pending] = []
        for pending in self.held():
            seen = self.book.assess(pending.req, ahead)
            if seen.verdict is not Verdict.FITS:
                pending.reason = seen.why
                ahead.append(pending)
            if now - pending.since > max_hold_s:
                out.append(pending)
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
        return self.book.shape_now(), bool(self._held)

    def preemptible_capacity(self, above_band: str) -> FreeCapacity:
        """Free capacity plus what `above_band` may preempt (same rule as `victims`)."""
        return self.book.capacity_view(self._candidates(above_band))

    def victims(self, req: MLRequirements, band: str) -> list[Allocation] | None:
        """A minimal set of jobs to preempt so that `req` fits ([] if it fits now).

        None when the request can never run here or no allowed set makes room.
        The policy (lowest band, newest first, then pruning) is in `policy`.
        """
        book = self.book
        if book.assess(req, ()).verdict is Verdict.NEVER:
            return None

        def fits(released: Sequence[Allocation]) -> bool:
            return book.assess(req, (), released).verdict is Verdict.FITS

        return choose_victims(self._candidates(band), fits)

    def waited(self, pending: Pending) -> float:
        """Seconds `pending` has been held, on this allocator's clock."""
        return self._clock() - pending.since

    def held(self) -> list[Pending]:
        """Held requests in queue order: the order `pump` serves them in."""
        return sorted(self._held.values(), key=self._order)

    def held_keys(self) -> KeysView[Hashable]:
        """The keys of the held requests, in no order (a live view: copy to keep it)."""
        return self._held.keys()

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for `celery inspect stats`, Flower and `celery ojs-ml status`."""
        book = self.book
        owners = {i: a.task_id for a in book.allocations() for i in a.devices}
        snap = {
            "capacity": _counts(book.total),
            "free": _counts(book.free_after(())),
            "devices": {str(i): owners.get(i) for i in range(self._caps.gpu_count)},
            "allocations": [a.as_dict() for a in book.allocations()],
            "held": [p.as_dict() for p in self.held()],
        }
        pools = book.pools
        if pools:  # only while any is held: the heartbeat stays as small as before
            snap["reservations"] = {rid: _counts(d) for rid, d in pools.items()}
        if book.sharing:  # sharing on: the scheduler's per-device fit reads it
            snap["gpu_free_milli"] = list(book.gpu_free_milli())
        if self._peers is not None:  # the scheduler places NVLink jobs on free islands
            free = set(range(self._caps.gpu_count)) - book.taken(())
            snap["nvlink_free"] = largest_peer_set(free, self._peers)
        return snap

    def _check_new(self, key: Hashable) -> None:
        running = self.book.get(key) is not None
        if running or key in self._held:
            state = "running" if running else "held"
            raise AllocatorError(
                f"key {key!r} is already {state}; free() or cancel() it before allocating "
                "again (RFC 27: one alloc request per job)"
            )

    def _order(self, p: Pending) -> tuple[int, int, float, int]:
        return (-rank(p.band), -p.priority, p.since, self._seq.get(p.key, -1))

    def _candidates(self, band: str) -> list[Allocation]:
        allow = self._allow_on_demand
        return [a for a in self.allocations() if is_victim(a, band, allow_on_demand=allow)]

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
        book = self.book
        want = Demand.of(req)
        pool = pool_of(req.ext_ml_reservation_id, book.pools)
        if want.short_of(book.free_in(pool, ()) if pool else book.free_after(())):
            raise AllocatorError(f"task {task_id} does not fit; refusing to overcommit")
        devices, milli = book.devices_for(req, want, prefer)
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
        book.add(key, RunningJob(alloc, dict(labels), pool))
        return alloc


def _counts(d: Demand) -> dict[str, float]:
    return {RESOURCE_NAMES[name]: amount for name, amount in d.items()}
