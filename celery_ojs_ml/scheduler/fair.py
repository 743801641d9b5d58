"""Fair sharing between queues: weighted max-min on GPUs, within each band (Kueue/Slurm).

Key decision: fairness changes only the order in which a pass considers jobs
of the same band, never what a job may use. Within a band, the next job is
taken from the queue whose GPUs (running and assigned, plus what this order
has already put ahead) divided by its weight is lowest; within a queue the
fleet order holds. Under contention each pass so hands freed GPUs to the
queue furthest below its weighted share, and the GPUs held converge to the
weights (weighted max-min; with one resource that is dominant resource
fairness). A queue without a weight has weight 1; a queue that asks for less
than its share leaves the rest to the others. The order is the order of the
whole pass, so reservations and backfill follow it. With a half-life
(`ojs_ml_fair_share_half_life_s`) each queue's count starts from its decayed
mean of GPUs held as well (`scheduler.usage`, Slurm's fair-share factor).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby

from celery_ojs_ml.scheduler.model import PendingJob, Policy, WorkerState
from celery_ojs_ml.scheduler.order import OrderKey, in_order, order_key


def holdings(fleet: Sequence[WorkerState]) -> Iterator[tuple[str, int]]:
    """(queue, GPUs) of every running job that holds its queue's GPUs: all but those
    that ended while their lease lingers (`RunningJob.ended`). Fair order and queue
    budgets both count these."""
    for w in fleet:
        for r in w.running:
            if not r.ended:
                yield r.queue, r.gpus


def held_gpus(
    fleet: Sequence[WorkerState], inflight: Iterable[tuple[str, int]] = ()
) -> dict[str, int]:
    """GPUs each queue holds now: the running jobs the fleet reports, plus the
    `inflight` (queue, GPUs) of jobs assigned but not yet reported running.

    Without the latter a pass that runs between an assignment and its lease
    sees the queue's share too low and hands it a second GPU."""
    out: dict[str, int] = {}
    for queue, gpus in (*holdings(fleet), *inflight):
        out[queue] = out.get(queue, 0) + gpus
    return out


def pass_order(
    jobs: list[PendingJob],
    fleet: Sequence[WorkerState],
    inflight: list[tuple[str, int]],
    policy: Policy,
    usage: Mapping[str, float] | None = None,
) -> tuple[list[PendingJob], dict[str, OrderKey]]:
    """The waiting jobs in the order a pass decides them, with their fair-share keys:
    fleet order, or fair order with weights; `usage`: each queue's decayed mean of GPUs
    held (`Usage.mean_gpus`), with a fair-share half-life."""
    ordered = in_order(jobs)
    orders: dict[str, OrderKey] = {}
    if policy.weights:
        base = usage if policy.fair_share_half_life_s > 0 else None
        fair = fair_order(ordered, held_gpus(fleet, inflight), dict(policy.weights), base)
        ordered = [job for job, _ in fair]
        orders = {job.task_id: key for job, key in fair}
    return ordered, orders


def fair_order(
    jobs: Iterable[PendingJob],
    held: Mapping[str, int],
    weights: Mapping[str, float],
    base: Mapping[str, float] | None = None,
) -> list[tuple[PendingJob, OrderKey]]:
    """Jobs in fair order with the order key each gets (see module doc); `base`: GPUs
    each queue counts on top of those it holds (its decayed mean, `scheduler.usage`)."""
    out: list[tuple[PendingJob, OrderKey]] = []
    start = {q: held.get(q, 0) + (base or {}).get(q, 0.0) for q in {*held, *(base or {})}}
    for _band, same in groupby(in_order(jobs), key=lambda j: order_key(j)[0]):
        out.extend(_interleave(list(same), start, weights, len(out)))
    return out


def _interleave(
    jobs: list[PendingJob], held: Mapping[str, float], weights: Mapping[str, float], start: int
) -> list[tuple[PendingJob, OrderKey]]:
    queues: dict[str, list[PendingJob]] = {}
    for job in jobs:
        queues.setdefault(job.queue, []).append(job)
    taken = {q: float(held.get(q, 0.0)) for q in queues}
    heap = [(_share(q, taken, weights), order_key(js[0]), q) for q, js in queues.items()]
    heapq.heapify(heap)
    pos = {q: 0 for q in queues}
    out: list[tuple[PendingJob, OrderKey]] = []
    while heap:
        _, _, q = heapq.heappop(heap)
        job = queues[q][pos[q]]
        pos[q] += 1
        band = order_key(job)[0]
        out.append((job, (band, start + len(out), 0.0, job.task_id)))
        # a CPU job counts as one; a gang's lead stands for all its ranks
        taken[q] += max(1, int(job.req.ext_ml_gpu_count or 0)) * job.gang_size
        if pos[q] < len(queues[q]):
            heapq.heappush(heap, (_share(q, taken, weights), order_key(queues[q][pos[q]]), q))
    return out


def _share(queue: str, taken: Mapping[str, float], weights: Mapping[str, float]) -> float:
    return taken[queue] / max(weights.get(queue, 1.0), 1e-9)


def weighted_split(
    total: float, demand: Mapping[str, float], weights: Mapping[str, float]
) -> dict[str, float]:
    """Each queue's weighted max-min share of `total` GPUs (water-filling): a queue gets
    its weight's part of what is left, or its whole `demand` where that is less, and
    what it leaves goes to the others. A queue without a weight has weight 1."""
    out = {q: 0.0 for q in demand}
    active = {q for q, d in demand.items() if d > 0}
    left = float(total)
    while active and left > 1e-9:
        part = left / sum(max(weights.get(q, 1.0), 1e-9) for q in active)
        capped = {q for q in active if demand[q] - out[q] <= part * max(weights.get(q, 1.0), 1e-9)}
        if not capped:
            for q in active:
                out[q] += part * max(weights.get(q, 1.0), 1e-9)
            break
        for q in capped:
            left -= demand[q] - out[q]
            out[q] = float(demand[q])
        active -= capped
    return out


def decayed_split(
    total: float,
    demand: Mapping[str, float],
    weights: Mapping[str, float],
    base: Mapping[str, float],
) -> dict[str, float]:
    """`weighted_split` where each queue already counts `base` GPUs (its decayed mean,
    `scheduler.usage`): the GPUs each queue holds once fair order with memory has
    handed out `total`, each `min(demand, max(0, level * weight - base))` at the one
    level that hands out `min(total, sum of demand)`; found by bisection."""
    want = min(float(total), sum(max(0.0, d) for d in demand.values()))

    def given(level: float) -> dict[str, float]:
        return {
            q: min(max(0.0, d), max(0.0, level * max(weights.get(q, 1.0), 1e-9) - base.get(q, 0.0)))
            for q, d in demand.items()
        }

    low, high = 0.0, 1.0
    while sum(given(high).values()) < want - 1e-9 and high < 1e18:
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(given(mid).values()) < want else (low, mid)
    return given(high)


@dataclass
class AheadShares:
    """Which jobs may wait ahead at a gate (`ojs_ml_prefetch`) under fair-share weights.

    A gate starts a job held ahead at the next end there, whichever queue's job
    ends, and knows no weights. So while another queue has jobs waiting, a job is
    sent ahead only where its start cannot push its queue past its weighted share
    (`weighted_split` of the fleet's GPUs): either it replaces a job of its own
    queue (every job running or assigned on that worker is of its queue) and the
    queue is within its share now, or the queue stays within its share with it
    and every job of the queue already held ahead counted as running. Elsewhere
    the next pass hands the freed GPUs out in fair order, a few milliseconds
    later. With no other queue waiting there is no one to be unfair to."""

    share: dict[str, float]
    """Each queue's weighted share of the fleet's GPUs."""
    held: dict[str, int]
    """GPUs each queue holds: running, and assigned to start (not held ahead)."""
    ahead: dict[str, int]
    """GPUs of each queue's jobs held ahead at gates."""
    queues_on: dict[str, set[str]]
    """Per worker: the queues of its running and assigned jobs."""
    waiting: dict[str, int] = field(default_factory=dict)
    """GPUs of each queue's jobs waiting (neither assigned nor held ahead)."""

    def admits(self, job: PendingJob | None, worker: str) -> bool:
        """Whether `job` may wait ahead at `worker`'s gate."""
        if job is None:
            return False
        queue, gpus = job.queue, int(job.req.ext_ml_gpu_count or 0)
        if not any(n > 0 for q, n in self.waiting.items() if q != queue):
            return True  # no other queue waits: a start cannot take its GPU
        share = self.share.get(queue, 0.0) + 1e-9
        held = self.held.get(queue, 0)
        if self.queues_on.get(worker, set()) <= {queue}:
            return held <= share  # it takes the place of a job of its own queue
        return held + self.ahead.get(queue, 0) + gpus <= share

    def take(self, job: PendingJob, worker: str) -> None:
        """Count a job sent ahead to `worker`."""
        gpus = int(job.req.ext_ml_gpu_count or 0)
        self.ahead[job.queue] = self.ahead.get(job.queue, 0) + gpus
        # `waiting` counts a job without GPUs as 1 (`Prefetching._ahead_shares`)
        self.waiting[job.queue] = self.waiting.get(job.queue, 0) - max(1, gpus)
        self.queues_on.setdefault(worker, set()).add(job.queue)
