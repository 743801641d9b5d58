"""Prefetch (`ojs_ml_prefetch`): the next jobs wait at a worker's gate, ahead of capacity.

A mixin of `scheduling.FleetScheduler`, split out of it to keep modules small;
every attribute below is set by `FleetScheduler.__init__`.

Key decisions:
* Only jobs that hold a reservation on a worker (the next in fleet order
  there) are delivered ahead, at most `ojs_ml_prefetch` per worker; the gate
  holds them and starts one the moment a job there ends, with no pass between.
  A gate that starts one wakes the leader, which then sends the next.
* A prefetched job is never stuck behind a busy worker while another could
  run it: each pass takes back (fenced by its token) every prefetched job that
  has not started when a worker other than its holder can start it now, with
  the capacity the pass left there. It is placed again in the next pass,
  without the back-off of a job a gate gave back (`_cooled_at`).
* A job that ranks above a preemptible job running on the worker it is reserved
  on is not delivered ahead: it may preempt there once its victims have run
  `ojs_ml_min_runtime_before_preemption_s`, and only a pass plans that.
* A delivered job is `assigned`: RFC 27 prioritize takes it back first (fenced by
  its token), so it is placed again in its new order (`OJSML.prioritize`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from celery_ojs_ml.allocator.model import Demand, rank
from celery_ojs_ml.integration.fleet_view import pending_job
from celery_ojs_ml.matching import FreeCapacity
from celery_ojs_ml.matching.match import hard_reasons
from celery_ojs_ml.pending import ASSIGNED, PendingBook
from celery_ojs_ml.scheduler import Decision, PendingJob, WorkerState
from celery_ojs_ml.scheduler.settle import lowest_preemptible
from celery_ojs_ml.spec.resources import MLRequirements

log = logging.getLogger("celery_ojs_ml.integration.scheduling")


class Prefetching:
    """Deliver reserved jobs ahead of capacity, and take them back when others free first."""

    settings: Any
    book: PendingBook
    _prefetched: dict[str, str]
    _dirty: bool

    _deliver: Callable[..., None]
    """`FleetScheduler._deliver`."""
    parse: Callable[[Any], MLRequirements | None]
    """`Intake.parse`."""

    def _prefetch(
        self,
        decision: Decision,
        fleet: list[WorkerState],
        records: dict[str, dict[str, Any]],
        jobs: dict[str, PendingJob],
        now: float,
    ) -> None:
        """Deliver reserved jobs ahead of capacity (`ojs_ml_prefetch` per worker): their gate
        holds them and starts them as soon as a job there ends, without a pass between."""
        waiting = self._held_ahead(records)
        below = {w.name: lowest_preemptible(w.running) for w in fleet}
        for r in decision.reservations:
            job = jobs.get(r.task_id)
            if job is None or job.gang is not None or job.gpu_affinity == "dedicated":
                continue
            if r.worker in below and rank(job.band) > below[r.worker]:
                continue  # it may preempt there once its victims are old enough: a pass decides
            if job.not_before > now:  # sitting out a give-back: not sent back at once
                continue
            if waiting.get(r.worker, 0) >= self.settings.prefetch:
                continue
            waiting[r.worker] = waiting.get(r.worker, 0) + 1
            self._deliver(r.task_id, r.worker, records[r.task_id], job, (), now, prefetch=True)

    def _held_ahead(self, records: dict[str, dict[str, Any]]) -> dict[str, int]:
        """Prefetched jobs not started yet, per worker."""
        out: dict[str, int] = {}
        for task_id, worker in list(self._prefetched.items()):
            record = records.get(task_id)
            if record is None or record.get("state") != ASSIGNED:
                del self._prefetched[task_id]
            else:
                out[worker] = out.get(worker, 0) + 1
        return out

    def _unhold(
        self,
        decision: Decision,
        fleet: list[WorkerState],
        records: dict[str, dict[str, Any]],
        jobs: dict[str, PendingJob],
    ) -> None:
        """Take back prefetched jobs that another worker can start now (see module doc)."""
        held = [(t, w) for t, w in self._prefetched.items() if t not in jobs]
        if not held:
            return
        left = {w.name: w.free for w in fleet}
        for a in decision.assignments:
            job = jobs.get(a.task_id)
            if job is not None and a.worker in left:
                left[a.worker] = _less(left[a.worker], Demand.of(job.req))
        for task_id, holder in held:
            record = records.get(task_id)
            if record is None or record.get("state") != ASSIGNED or record.get("worker") != holder:
                continue
            job = pending_job(task_id, record, self.parse)
            if job is None:
                continue
            other = _starts_now(job, fleet, left, holder)
            if other is None:
                continue
            why = f"{other} can start it now, {holder} is still busy"
            if self.book.take_back(task_id, str(record.get("token")), why, cool=False):
                log.info("ojs-ml: took prefetched %s back from %s: %s", task_id, holder, why)
                del self._prefetched[task_id]
                left[other] = _less(left[other], Demand.of(job.req))
                self._dirty = True


def _starts_now(
    job: PendingJob, fleet: list[WorkerState], left: dict[str, FreeCapacity], holder: str
) -> str | None:
    """A worker other than `holder` that consumes the job's queue and fits it now."""
    for worker in fleet:
        if worker.name == holder or not worker.available or job.queue not in worker.queues:
            continue
        if not hard_reasons(job.req, worker.caps, left[worker.name]):
            return worker.name
    return None


def _less(free: FreeCapacity, used: Demand) -> FreeCapacity:
    """`free` less a job's demand (an untracked resource stays untracked)."""

    def minus(have: Any, take: Any) -> Any:
        return None if have is None else have - take

    return dataclasses.replace(
        free,
        gpus=minus(free.gpus, used.gpus),
        cpu_cores=minus(free.cpu_cores, used.cpu_cores),
        memory_gb=minus(free.memory_gb, used.memory_gb),
        tpu_chips=minus(free.tpu_chips, used.tpu_chips),
    )
