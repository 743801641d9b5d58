"""Invariant checks over one scheduling pass, written independently of the scheduler.

Each takes what the pass was given (pending jobs, fleet, now, policy) and the
`Decision`, and fails with a message naming the jobs and worker involved.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from celery_ojs_ml.matching import Verdict, match
from celery_ojs_ml.scheduler import Decision, PendingJob, Policy, RunningJob, WorkerState
from celery_ojs_ml.scheduler.order import order_key
from celery_ojs_ml.scheduler.slot import running_vec
from celery_ojs_ml.scheduler.vectors import (
    ZERO,
    Vec,
    clip,
    covers,
    demand_of,
    finite,
    from_free,
    minus,
    plus,
    sum_of,
    to_free,
    totals_of,
)


class Pass:
    """One pass's inputs and output, indexed for the checks."""

    def __init__(
        self,
        pending: Sequence[PendingJob],
        fleet: Sequence[WorkerState],
        now: float,
        policy: Policy,
        decision: Decision,
    ) -> None:
        self.now, self.policy, self.decision = now, policy, decision
        self.jobs = {j.task_id: j for j in pending}
        self.workers = {w.name: w for w in fleet}
        self.on: dict[str, list[PendingJob]] = defaultdict(list)
        for a in decision.assignments:
            self.on[a.worker].append(self.jobs[a.task_id])
        self.preempting = {
            t: a.worker
            for t, a in decision.annotations.items()
            if "; preempting " in a.reason_pending
        }

    def order(self, task_id: str) -> tuple[int, int, float, str]:
        return order_key(self.jobs[task_id])

    def victims_of(self, task_id: str, worker: WorkerState) -> list[RunningJob]:
        planned = {v for p in self.decision.preemptions if p.task_id == task_id for v in p.victims}
        return [r for r in worker.running if r.preempted_for == task_id or r.task_id in planned]

    def leaving(self, worker: WorkerState) -> set[str]:
        planned = {
            v for p in self.decision.preemptions if p.worker == worker.name for v in p.victims
        }
        return planned | {r.task_id for r in worker.running if r.preempted_for is not None}


def capacity_is_safe(p: Pass) -> None:
    """Invariant 1: no worker is given more than it has free; dedicated takes an idle one."""
    for name, jobs in p.on.items():
        w = p.workers[name]
        free = from_free(w.free)
        for job in jobs:
            want = demand_of(job.req)
            assert covers(free, want), f"{job.task_id} on {name}: wants {want}, free {free}"
            if job.gpu_affinity == "dedicated":
                assert not w.running and len(jobs) == 1, f"dedicated {job.task_id} shares {name}"
            free = minus(free, want)


def placement_is_right(p: Pass) -> None:
    """Invariant 2: every assignment satisfies every hard constraint (matching says FITS)."""
    for name, jobs in p.on.items():
        w = p.workers[name]
        assert w.available, f"{name} is away but got {[j.task_id for j in jobs]}"
        free, labels = from_free(w.free), tuple(w.free.running_labels)
        for job in jobs:
            assert job.queue in w.queues, f"{job.task_id} ({job.queue}) on {name} ({w.queues})"
            found = match(job.req, w.caps, to_free(free, labels))
            assert found.verdict is Verdict.FITS, f"{job.task_id} on {name}: {found.reasons}"
            free = minus(free, demand_of(job.req))
            labels = (*labels, job.labels) if job.labels else labels


def order_is_kept(p: Pass) -> None:
    """Invariant 4/rule 1: no waiting job could use capacity a lower-ordered job was given.

    A waiting job H "could use" worker W if H fits on W with everything given to
    jobs behind H handed back. That is allowed only when W is held for a job
    ahead of H (its reservation, or its preemption).
    """
    assigned = p.decision.assigned()
    held: dict[str, list[tuple[int, int, float, str]]] = defaultdict(list)
    for r in p.decision.reservations:
        held[r.worker].append(p.order(r.task_id))
    for task_id, worker in p.preempting.items():
        held[worker or ""].append(p.order(task_id))
    for h in p.jobs.values():
        if h.task_id in assigned or h.task_id in p.preempting or h.gpu_affinity == "dedicated":
            continue
        note = p.decision.annotations.get(h.task_id)
        if note is not None and " budget: " in note.reason_pending:
            continue  # over its queue's budget (§10.3): others may pass it
        for w in p.workers.values():
            behind = [j for j in p.on[w.name] if order_key(j) > order_key(h)]
            if not behind or not w.available or h.queue not in w.queues:
                continue
            if any(j.gpu_affinity == "dedicated" for j in p.on[w.name]):
                continue
            ahead = [j for j in p.on[w.name] if order_key(j) < order_key(h)]
            free = minus(from_free(w.free), sum_of(demand_of(j.req) for j in ahead))
            if (
                match(h.req, w.caps, to_free(free, tuple(w.free.running_labels))).verdict
                is Verdict.FITS
            ):
                reason = [j.task_id for j in behind]
                assert any(k < order_key(h) for k in held[w.name]), (
                    f"{h.task_id} waits while {reason}, behind it, took {w.name}"
                )


def reservations_hold(p: Pass) -> None:
    """Invariant 7: at its reserved start, the reserved job fits beside everything still there.

    Jobs started this pass count until their time limit ends (none: for ever),
    running jobs until theirs, victims until their grace period ends, jobs
    preempting until theirs, and reservations ahead on the same worker while active.
    A preemptible spot job counts, for a holder above spot, only until the holder may
    preempt it (its minimum runtime, then the grace period): it is reserved where it
    will start by preemption (docs/scheduling.md, "What holds a drain").
    """
    for r in p.decision.reservations:
        if r.start is None:
            continue
        w = p.workers[r.worker]
        capacity = _capacity(w)
        used = _used_at(p, w, r.start, r.task_id, capacity)
        job = p.jobs[r.task_id]
        want = capacity if job.gpu_affinity == "dedicated" else demand_of(job.req)
        assert covers(minus(capacity, used), want), (
            f"{r.task_id} reserved on {w.name} from {r.start}: {used} in use there then"
        )


def _capacity(w: WorkerState) -> Vec:
    """All the worker can hand out once idle (pool processes: infinite where untracked)."""
    free = from_free(w.free)
    processes = free[4] + len(w.running)
    if any(x.exclusive for x in w.running):
        return (*totals_of(w.caps)[:4], processes)
    return (*plus(finite(free), sum_of(running_vec(x) for x in w.running))[:4], processes)


def _used_at(p: Pass, w: WorkerState, at: float, holder: str, capacity: Vec) -> Vec:
    gone_at = p.now + p.policy.preemption_grace_s
    leaving = p.leaving(w)
    preempts = p.policy.preemption and p.jobs[holder].band != "spot"
    used = ZERO
    for x in w.running:
        end = x.ends_at if x.ends_at is None or x.ends_at > p.now else p.now + p.policy.overdue_s
        if x.task_id in leaving:
            end = gone_at if end is None else min(end, gone_at)
        if preempts and x.yields_drain:
            aged = max(p.now, x.started_at + p.policy.min_runtime_before_preemption_s)
            end = (
                aged + p.policy.preemption_grace_s
                if end is None
                else min(end, aged + p.policy.preemption_grace_s)
            )
        if end is None or end > at:
            used = plus(used, capacity if x.exclusive else running_vec(x))
    for job in p.on[w.name]:
        if job.time_limit_s is None or p.now + job.time_limit_s > at:
            used = plus(used, demand_of(job.req))
    for task_id, worker in p.preempting.items():
        if worker == w.name:
            used = plus(used, _claimed_at(p, w, task_id, at, gone_at))
    for other in p.decision.reservations:
        job = p.jobs[other.task_id]
        if (
            other.worker != w.name
            or other.start is None
            or p.order(other.task_id) >= p.order(holder)
        ):
            continue
        if other.start <= at and (job.time_limit_s is None or other.start + job.time_limit_s > at):
            used = plus(used, demand_of(job.req))
    return used


def _claimed_at(p: Pass, w: WorkerState, task_id: str, at: float, gone_at: float) -> Vec:
    """What a preempting job holds on `w` at `at`: its free share now, all of it once victims go."""
    job = p.jobs[task_id]
    if job.time_limit_s is not None and gone_at + job.time_limit_s <= at:
        return ZERO
    want = demand_of(job.req)
    if at >= gone_at:
        return want
    return clip(minus(want, sum_of(running_vec(v) for v in p.victims_of(task_id, w))))
