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
whole pass, so reservations and backfill follow it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from itertools import groupby

from celery_ojs_ml.scheduler.model import PendingJob, WorkerState
from celery_ojs_ml.scheduler.order import OrderKey, in_order, order_key


def held_gpus(
    fleet: Sequence[WorkerState], inflight: Iterable[tuple[str, int]] = ()
) -> dict[str, int]:
    """GPUs each queue holds now: the running jobs the fleet reports, plus the
    `inflight` (queue, GPUs) of jobs assigned but not yet reported running.

    Without the latter a pass that runs between an assignment and its lease
    sees the queue's share too low and hands it a second GPU."""
    out: dict[str, int] = {}
    for w in fleet:
        for r in w.running:
            out[r.queue] = out.get(r.queue, 0) + r.gpus
    for queue, gpus in inflight:
        out[queue] = out.get(queue, 0) + gpus
    return out


def fair_order(
    jobs: Iterable[PendingJob], held: Mapping[str, int], weights: Mapping[str, float]
) -> list[tuple[PendingJob, OrderKey]]:
    """Jobs in fair order with the order key each gets (see module doc)."""
    out: list[tuple[PendingJob, OrderKey]] = []
    for _band, same in groupby(in_order(jobs), key=lambda j: order_key(j)[0]):
        out.extend(_interleave(list(same), held, weights, len(out)))
    return out


def _interleave(
    jobs: list[PendingJob], held: Mapping[str, int], weights: Mapping[str, float], start: int
) -> list[tuple[PendingJob, OrderKey]]:
    queues: dict[str, list[PendingJob]] = {}
    for job in jobs:
        queues.setdefault(job.queue, []).append(job)
    taken = {q: float(held.get(q, 0)) for q in queues}
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
        taken[q] += max(1, int(job.req.ext_ml_gpu_count or 0))  # a CPU job counts as one
        if pos[q] < len(queues[q]):
            heapq.heappush(heap, (_share(q, taken, weights), order_key(queues[q][pos[q]]), q))
    return out


def _share(queue: str, taken: Mapping[str, float], weights: Mapping[str, float]) -> float:
    return taken[queue] / max(weights.get(queue, 1.0), 1e-9)
