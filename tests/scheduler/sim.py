"""A tiny discrete-time fleet driven by `schedule()`: the test double of the live scheduler.

Running jobs end after their own duration (never past their time limit), and
victims of a preemption leave at the next step and wait again with their
original submit time, as the re-publish protocol does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.scheduler import (
    Decision,
    PendingJob,
    Policy,
    ReservationPool,
    RunningJob,
    WorkerState,
    schedule,
)
from celery_ojs_ml.scheduler.pools import PREFIX
from celery_ojs_ml.scheduler.vectors import demand_of


@dataclass
class SimWorker:
    caps: Capabilities
    running: dict[str, RunningJob] = field(default_factory=dict)
    available: bool = True
    queues: frozenset[str] = frozenset({"celery"})

    def state(self, name: str) -> WorkerState:
        running = list(self.running.values())
        return WorkerState.of(
            name, self.caps, running, queues=self.queues, available=self.available
        )


@dataclass
class Sim:
    now: float = 0.0
    policy: Policy = field(default_factory=Policy)
    workers: dict[str, SimWorker] = field(default_factory=dict)
    pending: dict[str, PendingJob] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    ends: dict[str, float] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    jobs: dict[str, PendingJob] = field(default_factory=dict)
    """Every job ever submitted, by task id (for re-queueing)."""
    pools: dict[str, ReservationPool] = field(default_factory=dict)
    """Dynamic reservations (§8.3) by id; the sim's gates never report holding them."""
    denied: list[str] = field(default_factory=list)

    def submit(self, job: PendingJob, duration: float) -> None:
        """Admit `job` now; it will run for `duration` s (capped at its time limit)."""
        if job.time_limit_s is not None:
            duration = min(duration, job.time_limit_s)
        job = replace(job, submitted_at=self.now)
        self.pending[job.task_id] = self.jobs[job.task_id] = job
        self.durations[job.task_id] = duration

    def fleet(self) -> list[WorkerState]:
        return [w.state(name) for name, w in self.workers.items()]

    def advance(self, dt: float) -> None:
        """Move the clock; finished jobs leave, victims leave and wait again."""
        self.now += dt
        for w in self.workers.values():
            for task_id, r in list(w.running.items()):
                if r.preempted_for is not None:
                    del w.running[task_id]
                    self._requeue(r.task_id)
                elif self.ends[task_id] <= self.now:
                    del w.running[task_id]
                    self.done.append(task_id)

    def lose(self, name: str) -> None:
        """A worker dies: its jobs wait again; its reservations are placed again."""
        for task_id in self.workers.pop(name).running:
            self._requeue(task_id)
        for rid, pool in list(self.pools.items()):
            if pool.worker == name:
                self.pools[rid] = replace(pool, worker=None)

    def _requeue(self, task_id: str) -> None:
        self.pending[task_id] = self.jobs[task_id]
        self.started.pop(task_id, None)

    def step(self) -> Decision:
        """One pass at `now`, applied."""
        decision = self.decide()
        self.apply(decision)
        return decision

    def decide(self) -> Decision:
        """One pass at `now` over the pending jobs and the fleet."""
        return schedule(
            list(self.pending.values()),
            self.fleet(),
            self.now,
            self.policy,
            pools=list(self.pools.values()),
        )

    def apply(self, decision: Decision) -> None:
        """Assignments start; victims are flagged and leave at the next `advance`."""
        for a in decision.assignments:
            if a.task_id.startswith(PREFIX):
                rid = a.task_id[len(PREFIX) :]
                self.pools[rid] = replace(self.pools[rid], worker=a.worker)
                continue
            self._start(self.pending.pop(a.task_id), a.worker)
        for d in decision.denials:
            self.pending.pop(d.task_id, None)
            self.denied.append(d.task_id)
        for p in decision.preemptions:
            running = self.workers[p.worker].running
            for victim in p.victims:
                running[victim] = replace(running[victim], preempted_for=p.task_id)

    def _start(self, job: PendingJob, name: str) -> None:
        g, cpu, mem, tpu, _ = demand_of(job.req)
        self.started[job.task_id] = self.now
        self.ends[job.task_id] = self.now + self.durations[job.task_id]
        self.workers[name].running[job.task_id] = RunningJob(
            job.task_id,
            job.band,
            self.now,
            priority=job.priority,
            gpus=int(g),
            cpu_cores=cpu,
            memory_gb=mem,
            tpu_chips=int(tpu),
            time_limit_s=job.time_limit_s,
            preemptible=job.band == "spot",
            labels=job.labels,
            exclusive=job.gpu_affinity == "dedicated",
            queue=job.queue,
            reservation=job.req.ext_ml_reservation_id,
        )
