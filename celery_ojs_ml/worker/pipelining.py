"""Pipelining: a held job is written to the warm child of the running job whose devices
it will take, behind it (`ojs_ml_pipeline`).

Key decisions:
* Serving sends many short requests of one class to one GPU. Plain Celery writes the
  next request to its pool process as the running one's result comes back; without
  pipelining the gate frees the devices, allocates and writes the next job only once the
  result has come back. A job that would wait at the gate, whose requirements equal
  those of a job running here in a warm child, is written to that child at once: the
  child reads it as it returns the running job's result.
* Capacity holds: a child runs one job at a time, so the devices are never used by two
  jobs at once. The follower holds no allocation while the job ahead runs; when that
  job ends `Allocator.hand_over` gives it exactly those devices (the backfill rule does
  not apply: it is already in the child), and its lease, start and event follow as at
  any dispatch. Pinned where CUDA was born: its devices are those the child is bound to.
* Only behind short jobs: the last run of the follower's task here took at most
  `ojs_ml_grant_wait_s`. A follower's start is recorded when it is written (a copy
  the scheduler fenced must never reach a child), so it can no longer be taken back
  or given back; behind a long job it would wait where a free worker could run it.
* Only where nothing else is owed those devices: no job is held at the gate (or the
  follower is the first held, in queue order); the job ahead is not being stopped,
  fenced or preempted, was not moved onto other devices, and has nothing behind it
  yet; neither is a gang rank, a batch, a GPU share, a TPU job, pinned to CPUs or in a
  reservation. A held job that outranks the follower when it takes over preempts it,
  as it would any running job.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from celery_ojs_ml.allocator import Allocation, Allocator
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.wire.headers import RENDEZVOUS
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.preemption import Preemptions
from celery_ojs_ml.worker.running import Running


class Pipeline:
    """Which running job a held job may follow, and who follows whom (under the gate's lock)."""

    def __init__(
        self,
        settings: OJSMLSettings,
        allocator: Allocator,
        running: Running,
        preemptions: Preemptions,
        *,
        router: Any,
        requirements: Callable[[Any], MLRequirements],
        batched: Callable[[Any], bool],
    ) -> None:
        self.settings, self.allocator, self.running = settings, allocator, running
        self.preemptions, self.router = preemptions, router
        self.requirements, self.batched = requirements, batched
        self.followers: dict[str, tuple[Any, MLRequirements]] = {}
        """Task id of a running job -> the request written behind it, with its requirements."""
        self.last_run_s: dict[str, float] = {}
        """Task name -> how long its last run here took (bounded)."""

    def ended(self, req: Any, alloc: Allocation) -> None:
        """A job ended: remember how long its task runs."""
        if len(self.last_run_s) > 1000:
            self.last_run_s.clear()
        self.last_run_s[str(req.name)] = time.monotonic() - alloc.started_at

    def ahead_for(self, req: Any, ml: MLRequirements) -> Allocation | None:
        """The allocation of a running job `req` may follow, or None."""
        if not self._may_follow_at_all(req, ml):
            return None
        for alloc in self.allocator.allocations():
            if self._may_lead(alloc) and self._same_needs(alloc.key, ml):
                return alloc
        return None

    def follow(self, req: Any, ml: MLRequirements, ahead: Allocation) -> None:
        """Record `req` behind `ahead` and have the router write it to that child."""
        self.followers[ahead.task_id] = (req, ml)
        self.router.follow(req.id, ahead.task_id)

    def follower_of(self, task_id: str) -> tuple[Any, MLRequirements] | None:
        """The job written behind `task_id`, which has ended (forgotten here)."""
        return self.followers.pop(task_id, None)

    def _may_follow_at_all(self, req: Any, ml: MLRequirements) -> bool:
        short = self.last_run_s.get(str(req.name), math.inf) <= self.settings.grant_wait_s
        return short and not (
            ml.ext_ml_reservation_id is not None
            or RENDEZVOUS in req.request_dict
            or (ml.ext_ml_gpu_count or 0) < 1
            or self.batched(req)
        )

    def _may_lead(self, alloc: Allocation) -> bool:
        running, lead = self.running, alloc.key
        return bool(
            alloc.devices
            and not alloc.gpu_milli
            and not alloc.tpu_chips
            and not (self.settings.pin_cpus and alloc.cpu_cores > 0)
            and alloc.task_id not in self.followers
            and lead not in running.fenced
            and lead not in running.stopping
            and lead not in self.preemptions
            and self.router.may_follow(alloc.task_id)
        )

    def _same_needs(self, lead: Any, ml: MLRequirements) -> bool:
        try:
            return self.requirements(lead) == ml
        except Exception:  # its headers no longer parse: nothing follows it
            return False
