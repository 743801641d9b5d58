"""One worker during one scheduling pass: free now, what the pass put on it, its holds.

Key decision: a slot never changes the reported state; it layers the pass's
own decisions (assignments, reservations, victims to preempt) on top of it,
and rebuilds its `Timeline` from scratch when asked after a change. Rebuilds
are lazy and cheap (a worker runs a handful of jobs), and a timeline that is
rebuilt cannot drift from the decisions it describes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from celery_ojs_ml.allocator.sharing import FULL, after, place
from celery_ojs_ml.scheduler.model import Policy, RunningJob, WorkerState
from celery_ojs_ml.scheduler.timeline import Timeline
from celery_ojs_ml.scheduler.vectors import (
    INF,
    ZERO,
    Vec,
    finite,
    from_free,
    minus,
    plus,
    totals_of,
)

HoldKind = Literal["reserve", "preempt", "shadow"]
LabelKey = tuple[tuple[str, str], ...]
Shape = tuple[Vec, tuple[LabelKey, ...], bool, tuple[int, ...] | None, int | None]
"""What decides a match on a worker besides its capabilities: free vector, running labels,
idle, milli-GPU left per device (None: sharing off), and the largest set of free NVLink
peers (None: not known)."""


@dataclass(frozen=True, slots=True)
class Hold:
    """Capacity taken from `start` to `end` (None: for ever) for a waiting job.

    `reserve`: a reservation; backfill on the worker must leave it whole.
    `preempt`: what the victims of a preemption free, passed on to the job
    that preempts them; nothing else could take it, so it needs no check.
    `shadow`: a start estimate; it shapes later estimates, never backfill.
    """

    task_id: str
    order: tuple[object, ...]
    start: float
    end: float | None
    amount: Vec
    kind: HoldKind


def running_vec(r: RunningJob) -> Vec:
    """A running job's counted footprint as a vector."""
    return (float(r.gpus), float(r.cpu_cores), float(r.memory_gb), float(r.tpu_chips), 1.0)


def label_key(labels: Mapping[str, str]) -> LabelKey:
    """Labels as a hashable, order-free key."""
    return tuple(sorted(labels.items()))


class Slot:
    """A worker's state in this pass (see module doc)."""

    __slots__ = (
        "_drain",
        "_firm",
        "_held_whole",
        "_preempting",
        "_shape",
        "_timeline",
        "added_labels",
        "assigned",
        "capacity",
        "exclusive",
        "free",
        "gpu_free",
        "grace_s",
        "group",
        "held_ends",
        "holds",
        "idle",
        "idx",
        "labels",
        "linked",
        "min_age_s",
        "now",
        "overdue_s",
        "state",
        "version",
        "victims",
        "whole",
        "yielding",
    )

    def __init__(self, idx: int, state: WorkerState, now: float, policy: Policy) -> None:
        self.idx = idx
        self.state = state
        self.now = now
        self.overdue_s = policy.overdue_s
        self.grace_s = policy.preemption_grace_s
        self.min_age_s = policy.min_runtime_before_preemption_s
        self.yielding = policy.preemption  # preemptible spot jobs hold no drain
        self.group = -1
        self.free = from_free(state.free)
        self.gpu_free = state.gpu_free_milli
        self.linked = state.nvlink_free
        self.labels: list[Mapping[str, str]] = list(state.free.running_labels)
        self.added_labels: list[Mapping[str, str]] = []
        self.idle = not state.running
        self.capacity = self._capacity()
        # What an exclusive (dedicated) running job gives back: the whole worker.
        self.whole = minus(self.capacity, finite(self.free))
        self.assigned: list[tuple[Vec, float | None]] = []
        self.held_ends: list[float | None] = []  # of the assigned jobs that hold the drain
        self.holds: list[Hold] = []
        self.victims: dict[str, RunningJob] = {
            r.task_id: r for r in state.running if r.preempted_for is not None
        }
        self.exclusive = False
        self.version = 0
        self._timeline: Timeline | None = None
        self._preempting: Timeline | None = None
        self._shape: Shape | None = None
        self._drain: float | None = None
        self._firm = 0  # reservations among `holds`
        self._held_whole = any(r.exclusive for r in state.running)

    def _capacity(self) -> Vec:
        """Everything the worker can hand out once idle."""
        if any(r.exclusive for r in self.state.running):
            total = totals_of(self.state.caps)  # its processes: free ones and running jobs
            return (*total[:4], finite(self.free)[4] + len(self.state.running))
        used = ZERO
        for r in self.state.running:
            used = plus(used, running_vec(r))
        return plus(finite(self.free), used)

    @property
    def name(self) -> str:
        """The worker's name."""
        return self.state.name

    @property
    def closed(self) -> bool:
        """Whether a dedicated job has the whole worker: nothing else may start there."""
        return self.exclusive or self._held_whole

    @property
    def reserved(self) -> bool:
        """Whether a reservation lies on it (then backfill is checked against its timeline)."""
        return self._firm > 0

    def shape(self) -> Shape:
        """The equivalence key of this worker's free state (see `Shape`)."""
        if self._shape is None:
            labels = tuple(label_key(x) for x in self.labels)
            self._shape = (self.free, labels, self.idle, self.gpu_free, self.linked)
        return self._shape

    def take(
        self,
        amount: Vec,
        end: float | None,
        labels: Mapping[str, str],
        *,
        whole: bool = False,
        yields: bool = False,
    ) -> None:
        """Start a job using `amount` now until `end` (None: unknown); `whole`: dedicated;
        `yields`: a preemptible spot job, which holds no drain (`drain_at`)."""
        self.exclusive = self.exclusive or whole
        self.free = minus(self.free, amount)
        if self.linked is not None and self.free[0] != INF:  # conservative: the gate may
            # take the devices off the island
            self.linked = max(0, min(self.linked - int(amount[0]), int(self.free[0])))
        if labels:
            self.labels.append(labels)
            self.added_labels.append(labels)
        self.idle = False
        self.assigned.append((amount, end))
        if not (yields and self.yielding):
            self.held_ends.append(end)
        self._changed()

    def take_devices(self, gpus: int, milli: int | None) -> bool:
        """Account a job on the per-device milli (sharing on): a share of `milli`, else
        `gpus` whole devices. True when a share opened an untouched device."""
        if self.gpu_free is None or (milli is None and gpus <= 0):
            return False
        free = self.gpu_free
        count, amount = (1, milli) if milli is not None else (gpus, FULL)
        devices = place(free, count, amount)
        if devices is None:
            return False
        self.gpu_free = after(free, devices, amount)
        self._changed()
        return milli is not None and free[devices[0]] >= FULL

    def hold(self, hold: Hold) -> None:
        """Add a reservation, a preemption's claim or a start estimate."""
        self.holds.append(hold)
        self._firm += hold.kind == "reserve"
        self._changed()

    def preempt(self, victims: list[RunningJob]) -> None:
        """Count `victims` as gone once their grace period ends."""
        for v in victims:
            self.victims[v.task_id] = v
        self._changed()

    def first_holder(self) -> str | None:
        """Task id of the reservation first in fleet order, if any."""
        firm = [h for h in self.holds if h.kind == "reserve"]
        return min(firm, key=lambda h: h.order).task_id if firm else None

    def timeline(self, preempting: bool = False) -> Timeline:
        """The step function of free capacity, rebuilt after any change. `preempting`: as
        a job above spot sees it, which may preempt: each preemptible spot job
        (`RunningJob.yields_drain`) is gone once it may be preempted (with preemption on;
        `Estimator.exact` adds the grace period). A worker with no such job has one."""
        if not (preempting and self.yielding and any(r.yields_drain for r in self.state.running)):
            if self._timeline is None:
                self._timeline = self._build(False)
            return self._timeline
        if self._preempting is None:
            self._preempting = self._build(True)
        return self._preempting

    def drain_at(self) -> float:
        """When a large job of a higher band could start on it: when every job on it
        (running or assigned this pass) but those it could preempt will have ended.

        `now` for an idle worker; infinity when one of them has no time limit. With
        preemption on, a preemptible spot job (`RunningJob.yields_drain`) is left out:
        it is preempted for such a job rather than waited for (docs/scheduling.md).
        """
        if self._drain is None:
            running = self.state.running
            held = [r for r in running if not r.yields_drain] if self.yielding else running
            ends = [self._end_of(r) for r in held]
            ends += self.held_ends
            self._drain = max((math.inf if e is None else e for e in ends), default=self.now)
        return self._drain

    def _end_of(self, r: RunningJob) -> float | None:
        end = r.ends_at
        if end is not None and end <= self.now:
            end = self.now + self.overdue_s
        if r.task_id in self.victims:
            gone = self.now + self.grace_s
            end = gone if end is None else min(end, gone)
        return end

    def _changed(self) -> None:
        self.version += 1
        self._timeline = None
        self._preempting = None
        self._shape = None
        self._drain = None

    def _build(self, preempting: bool) -> Timeline:
        tl = Timeline(self.now, self.free)
        for r in self.state.running:
            end = self._end_of(r)  # past its limit: expected to end shortly
            if preempting and r.yields_drain:
                gone = max(self.now, r.started_at + self.min_age_s)
                end = gone if end is None else min(end, gone)
            if end is not None:
                tl.add(end, self._release_of(r))
        for amount, end in self.assigned:
            if end is not None:
                tl.add(end, amount)
        for h in self.holds:
            tl.hold(h.start, h.end, h.amount, shadow=h.kind == "shadow")
        return tl

    def _release_of(self, r: RunningJob) -> Vec:
        """What a running job gives back: its footprint, or the whole worker if exclusive."""
        return self.whole if r.exclusive else running_vec(r)
