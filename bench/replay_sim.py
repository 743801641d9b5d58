"""The event-driven fleet of `bench/replay_time.py` and its three dispatch policies.

`Sim` moves a clock from event to event (arrivals, completions, wake-ups a
policy asks for), calls the policy once per distinct event time, and
integrates busy and idle-while-waiting GPU-seconds between events. Policies
(`pull`, `strict`, `ojs`) start waiting jobs on workers and preempt spot
jobs through `Sim.start` and `Sim.preempt`, which keep the invariants: a job
runs on one worker at a time, a worker never holds more than it has, a job
finishes exactly once. Preemption takes no time: the victims stop at the
moment they are chosen, lose the work since their last checkpoint (every
`CHECKPOINT_S` of run time, counted from their start), and wait again with
their original submit time and the rest of their duration.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.scheduler import (
    DEFAULT_POLICY,
    Memo,
    PendingJob,
    Policy,
    RunningJob,
    WorkerState,
    schedule,
)
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import MLRequirements

CHECKPOINT_S = 300.0
"""Spot jobs checkpoint this often; a preempted one loses `elapsed mod CHECKPOINT_S`."""
BAND_RANK = {"reserved": 0, "on-demand": 1, "spot": 2}
Kind = tuple[int, float, float]
"""What fitting depends on: GPUs, CPU cores, memory GB."""


@dataclass(frozen=True, slots=True)
class Job:
    """One job of a replay: its demand, band, arrival time and (capped) duration, s."""

    id: str
    order: int
    arrival: float
    gpus: int
    cpu: float
    mem: float
    band: str
    duration: float
    queue: str = "default"

    @property
    def kind(self) -> Kind:
        return (self.gpus, self.cpu, self.mem)


@dataclass(slots=True)
class Run:
    """A job running on a worker since `started`, with `remaining` s of work at its start."""

    job: Job
    started: float
    remaining: float
    token: int


@dataclass(slots=True)
class Worker:
    """A worker of the scaled cluster and what it runs."""

    name: str
    gpus: int
    cpu: float
    mem: float
    caps: Capabilities
    running: dict[str, Run] = field(default_factory=dict)
    free_gpus: int = 0
    free_cpu: float = 0.0
    free_mem: float = 0.0

    def __post_init__(self) -> None:
        self.free_gpus, self.free_cpu, self.free_mem = self.gpus, self.cpu, self.mem

    def fits(self, kind: Kind) -> bool:
        """Whether a job of `kind` fits this worker's free capacity now."""
        g, c, m = kind
        return g <= self.free_gpus and c <= self.free_cpu + 1e-9 and m <= self.free_mem + 1e-9

    def take(self, job: Job, sign: int) -> None:
        self.free_gpus -= sign * job.gpus
        self.free_cpu -= sign * job.cpu
        self.free_mem -= sign * job.mem


Observer = Callable[["Sim", list[str]], None]
"""Called after each policy pass with the ids of the jobs the pass started (tests)."""


class Sim:
    """The fleet over time; `run(policy)` replays every job to its end."""

    def __init__(self, workers: list[Worker], jobs: list[Job], seed: int = 0) -> None:
        self.workers = {w.name: w for w in workers}
        self.jobs = {j.id: j for j in jobs}
        self.rng = random.Random(seed)
        self.now = 0.0
        self.waiting: dict[str, Job] = {}
        self.remaining = {j.id: j.duration for j in jobs}
        self.where: dict[str, str] = {}
        self.first_start: dict[str, float] = {}
        self.finish: dict[str, float] = {}
        self.finished = 0
        self.preemptions = 0
        self.lost_gpu_s = 0.0
        self.busy_gpu_s = 0.0
        self.idle_wait_gpu_s = 0.0
        self.idle_total_gpu_s = 0.0
        self.idle_capable_gpu_s = 0.0
        self.queues = sorted({j.queue for j in jobs})
        self.held: dict[str, int] = dict.fromkeys(self.queues, 0)
        self.contended_s = 0.0
        """Time during which every queue had a job waiting."""
        self.contended_gpu_s: dict[str, float] = dict.fromkeys(self.queues, 0.0)
        """GPU-seconds each queue held while every queue had a job waiting."""
        self._contended = False
        self.passes = 0
        self._events: list[tuple[float, int, str, str, int]] = []
        self._seq = 0
        self._wakes: set[float] = set()
        self._started: list[str] = []
        self._busy = 0
        self._idle = 0
        self._idle_total = 0
        self._idle_capable = 0
        self._capable: dict[Kind, tuple[Worker, ...]] = {}
        for j in jobs:
            self._push(j.arrival, "arrive", j.id, 0)

    def _push(self, t: float, what: str, job_id: str, token: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, what, job_id, token))

    def wake_at(self, t: float) -> None:
        """Run the policy again at `t` (once per distinct time)."""
        if t > self.now and t not in self._wakes:
            self._wakes.add(t)
            self._push(t, "wake", "", 0)

    def run(self, policy: Callable[[Sim], None], observe: Observer | None = None) -> None:
        """Replay every event; the policy runs once per distinct event time."""
        while self._events:
            t = self._events[0][0]
            self.busy_gpu_s += (t - self.now) * self._busy
            self.idle_wait_gpu_s += (t - self.now) * self._idle
            self.idle_total_gpu_s += (t - self.now) * self._idle_total
            self.idle_capable_gpu_s += (t - self.now) * self._idle_capable
            if self._contended:
                self.contended_s += t - self.now
                for q, held in self.held.items():
                    self.contended_gpu_s[q] += (t - self.now) * held
            self.now = t
            self._wakes.discard(t)
            while self._events and self._events[0][0] == t:
                _, _, what, job_id, token = heapq.heappop(self._events)
                self._apply(what, job_id, token)
            self._started = []
            policy(self)
            self.passes += 1
            if observe is not None:
                observe(self, self._started)
            self._idle = self.idle_while_waiting()
            self._idle_total = self.idle_in_total()
            self._idle_capable = self.idle_if_packed()
            self._contended = len({j.queue for j in self.waiting.values()}) == len(self.queues)
        self.check()

    def _apply(self, what: str, job_id: str, token: int) -> None:
        if what == "arrive":
            self.waiting[job_id] = self.jobs[job_id]
        elif what == "end" and job_id in self.where:
            w = self.workers[self.where[job_id]]
            run = w.running[job_id]
            if run.token == token:  # else a stale end of a preempted run
                self._stop(w, run)
                self.finish[job_id] = self.now
                self.remaining[job_id] = 0.0
                self.finished += 1

    def start(self, job_id: str, name: str) -> None:
        """Start a waiting job on worker `name`; it must fit there now."""
        job = self.waiting.pop(job_id)
        w = self.workers[name]
        assert w.fits(job.kind), f"{job_id} does not fit {name}"
        self._seq += 1
        run = Run(job, self.now, self.remaining[job_id], self._seq)
        w.running[job_id] = run
        w.take(job, 1)
        self.where[job_id] = name
        self._busy += job.gpus
        self.held[job.queue] += job.gpus
        self.first_start.setdefault(job_id, self.now)
        self._started.append(job_id)
        self._push(self.now + run.remaining, "end", job_id, run.token)

    def preempt(self, name: str, job_id: str) -> None:
        """Stop a running spot job now; it waits again with the rest of its work."""
        w = self.workers[name]
        run = w.running[job_id]
        assert run.job.band == "spot", f"{job_id} is not preemptible"
        elapsed = self.now - run.started
        lost = math.fmod(elapsed, CHECKPOINT_S)
        self.remaining[job_id] = run.remaining - (elapsed - lost)
        self.lost_gpu_s += lost * run.job.gpus
        self.preemptions += 1
        self._stop(w, run)
        self.waiting[job_id] = run.job

    def _stop(self, w: Worker, run: Run) -> None:
        del w.running[run.job.id]
        del self.where[run.job.id]
        w.take(run.job, -1)
        self._busy -= run.job.gpus
        self.held[run.job.queue] -= run.job.gpus

    def idle_while_waiting(self) -> int:
        """Free GPUs on workers where at least one waiting job would fit now."""
        kinds = minimal_kinds(j.kind for j in self.waiting.values())
        return sum(
            w.free_gpus
            for w in self.workers.values()
            if w.free_gpus and any(w.fits(k) for k in kinds)
        )

    def idle_in_total(self) -> int:
        """All free GPUs, while some waiting job asks for no more GPUs than that in total."""
        free = sum(w.free_gpus for w in self.workers.values())
        fits = any(j.gpus <= free for j in self.waiting.values())
        return free if free and fits else 0

    def idle_if_packed(self) -> int:
        """Free GPUs on the workers able to run a waiting job whose free capacity, summed, fits it.

        A waiting job counts when the GPUs, cores and memory free on the
        workers whose whole capacity could ever hold it add up to what it asks
        (it could start now had those workers been packed for it); the free
        GPUs of those workers count as idle. Unlike `idle_in_total`, a job that
        only a busy worker can ever run, or whose cores or memory are not free,
        does not make the rest of the fleet idle.
        """
        counted: set[str] = set()
        for kind in minimal_kinds(j.kind for j in self.waiting.values()):
            able = self._able(kind)
            g, c, m = kind
            if (
                sum(w.free_gpus for w in able) >= g
                and sum(w.free_cpu for w in able) + 1e-9 >= c
                and sum(w.free_mem for w in able) + 1e-9 >= m
            ):
                counted.update(w.name for w in able)
        return sum(self.workers[n].free_gpus for n in counted)

    def _able(self, kind: Kind) -> tuple[Worker, ...]:
        hit = self._capable.get(kind)
        if hit is None:
            g, c, m = kind
            hit = self._capable[kind] = tuple(
                w
                for w in self.workers.values()
                if g <= w.gpus and c <= w.cpu + 1e-9 and m <= w.mem + 1e-9
            )
        return hit

    def check(self) -> None:
        """Every job finished exactly once, nothing waits or runs, all capacity is back."""
        assert self.finished == len(self.jobs) == len(self.finish), "a job was lost or doubled"
        assert not self.waiting and not self.where, "jobs left over"
        for w in self.workers.values():
            assert (w.free_gpus, w.running) == (w.gpus, {}), f"{w.name} not empty"

    def in_order(self) -> list[Job]:
        """Waiting jobs in fleet order: band, then submit time (all priorities are 0)."""
        return sorted(self.waiting.values(), key=lambda j: (BAND_RANK[j.band], j.order))


def minimal_kinds(kinds: Iterable[Kind]) -> list[Kind]:
    """The kinds no other kind is smaller than in every dimension (a job fits iff one does)."""
    out: list[Kind] = []
    for k in sorted(set(kinds)):
        if not any(o[0] <= k[0] and o[1] <= k[1] and o[2] <= k[2] for o in out):
            out.append(k)
    return out


# --- pull: the pre-scheduler behaviour -------------------------------------------


def pull(sim: Sim) -> None:
    """Workers, in a random order, each take the first FIFO job that fits them, in rounds.

    Then a reserved job that fits nowhere preempts spot jobs (newest first) on
    the first worker, in a random order, where that frees enough (the old gate).
    """
    names = list(sim.workers)
    sim.rng.shuffle(names)
    fifo = sorted(sim.waiting.values(), key=lambda j: j.order)
    taken = True
    while taken and fifo:
        taken = False
        for name in names:
            w = sim.workers[name]
            job = next((j for j in fifo if w.fits(j.kind)), None) if w.free_gpus else None
            if job is not None:
                sim.start(job.id, name)
                fifo.remove(job)
                taken = True
    for job in fifo:
        if job.band == "reserved" and job.id in sim.waiting:
            _pull_preempt(sim, job, names)


def _pull_preempt(sim: Sim, job: Job, names: list[str]) -> None:
    for name in names:
        w = sim.workers[name]
        spot = sorted(
            (r for r in w.running.values() if r.job.band == "spot"),
            key=lambda r: (r.started, r.token),
        )
        g, c, m = w.free_gpus, w.free_cpu, w.free_mem
        g += sum(r.job.gpus for r in spot)
        c += sum(r.job.cpu for r in spot)
        m += sum(r.job.mem for r in spot)
        if not (job.gpus <= g and job.cpu <= c + 1e-9 and job.mem <= m + 1e-9):
            continue
        while not w.fits(job.kind):
            sim.preempt(name, spot.pop().job.id)
        sim.start(job.id, name)
        return


# --- strict and ojs: the scheduler core ------------------------------------------


@lru_cache(maxsize=4096)
def requirements(kind: Kind, band: str) -> MLRequirements:
    """The job's canonical requirements (GPUs, CPU cores, memory, priority class)."""
    gpus, cpu, mem = kind
    attrs = {
        "ext_ml_gpu_count": gpus,
        "ext_ml_cpu_cores": max(1, math.ceil(cpu)),
        "ext_ml_memory_gb": mem,
        "ext_ml_priority_class": band,
    }
    return normalize(attrs).requirements


class Core:
    """Builds the scheduler's inputs from a `Sim` (cached where values do not change)."""

    def __init__(self) -> None:
        self.memo = Memo()
        self._pending: dict[tuple[str, float], PendingJob] = {}

    def pending(self, sim: Sim, jobs: Iterable[Job]) -> list[PendingJob]:
        out = []
        for j in jobs:
            key = (j.id, sim.remaining[j.id])
            p = self._pending.get(key)
            if p is None:
                p = self._pending[key] = PendingJob(
                    j.id,
                    requirements(j.kind, j.band),
                    submitted_at=j.arrival,
                    time_limit_s=sim.remaining[j.id],
                    band=j.band,
                    queue=j.queue,
                )
            out.append(p)
        return out

    def fleet(self, sim: Sim) -> list[WorkerState]:
        queues = frozenset(sim.queues)
        return [
            WorkerState.of(w.name, w.caps, _running(sim, w), queues=queues)
            for w in sim.workers.values()
        ]


def _running(sim: Sim, w: Worker) -> list[RunningJob]:
    out = []
    for r in w.running.values():
        spot = r.job.band == "spot"
        saved = CHECKPOINT_S * math.floor((sim.now - r.started) / CHECKPOINT_S)
        out.append(
            RunningJob(
                r.job.id,
                r.job.band,
                r.started,
                gpus=r.job.gpus,
                cpu_cores=float(max(1, math.ceil(r.job.cpu))),
                memory_gb=r.job.mem,
                time_limit_s=r.remaining,
                last_checkpoint_at=r.started + saved if spot else None,
                preemptible=spot,
                queue=r.job.queue,
            )
        )
    return out


def strict(core: Core) -> Callable[[Sim], None]:
    """Strict priority, no backfill: only the head of fleet order may start (never deferred,
    `scheduler.defer`), never preempts."""
    policy = Policy(preemption=False, reservation_depth=0, drain_defer_s=0.0)

    def dispatch(sim: Sim) -> None:
        while sim.waiting:
            head = sim.in_order()[0]
            decision = schedule(core.pending(sim, [head]), core.fleet(sim), sim.now, policy)
            if not decision.assignments:
                return
            sim.start(head.id, decision.assignments[0].worker)

    return dispatch


def ojs(core: Core, policy: Policy = DEFAULT_POLICY) -> Callable[[Sim], None]:
    """`schedule()` over every waiting job; assignments start, preemptions apply at once."""

    def dispatch(sim: Sim) -> None:
        for _ in range(8):  # victims leave at once; the next pass places their preemptor
            pending = core.pending(sim, sim.waiting.values())
            decision = schedule(pending, core.fleet(sim), sim.now, policy, memo=core.memo)
            for a in decision.assignments:
                sim.start(a.task_id, a.worker)
            for p in decision.preemptions:
                for victim in p.victims:
                    sim.preempt(p.worker, victim)
            later = [
                t for a in decision.annotations.values() if (t := a.t_estimate) and t > sim.now
            ]
            if later:
                sim.wake_at(min(later))
            if not decision.preemptions:
                return

    return dispatch
