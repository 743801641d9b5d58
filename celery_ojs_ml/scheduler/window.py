"""Which waiting jobs a pass between full passes decides, without reading the whole backlog.

Between full passes the leader decides only the first `queue_depth` jobs in fleet
order (Slurm's default_queue_depth, `Policy.queue_depth`); finding them by ordering
every waiting job made each pass O(backlog).

Key decision: the leader keeps a *window*, the first `size` waiting jobs as of its
last complete ordering. An unchanged job outside it orders after every job in it, so
while enough unchanged window jobs wait, a pass feeds the core only those, the
changed and new jobs and the jobs always decided (`Window.pick`); otherwise the
leader orders the whole backlog again (`Window.of`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery_ojs_ml.scheduler.model import PendingJob


def always_decided(job: PendingJob) -> bool:
    """Whether every pass decides `job`, wherever it is in order.

    Gang ranks (a gang is decided only with every rank in the pass), jobs of a
    reservation (the core places them apart from fleet order), and jobs that may escalate.
    """
    req = job.req
    return (
        job.gang is not None
        or req.ext_ml_reservation_id is not None
        or bool(req.ext_ml_priority_escalation and req.ext_ml_escalation_target_class)
    )


@dataclass(frozen=True, slots=True)
class Window:
    """The first jobs in order at the last complete ordering.

    A job outside the window that has not changed since orders after every job in
    it: its band, priority and submit time are what they were, and escalation, the
    one change time alone makes (§8.4), is handled by deciding every job that may
    escalate on every pass. So while at least `queue_depth` unchanged window jobs
    still wait, the first `queue_depth` jobs in order of (unchanged window jobs,
    changed jobs, jobs new since, jobs always decided) are the first `queue_depth` of
    the whole backlog. When fewer remain the leader orders everything again, once per
    `size - queue_depth` jobs started at most. Ordering all of 10,000 waiting jobs
    cost the leader 8 ms of CPU per job it started (`bench/dispatch_cpu.py --tasks
    10000 --segments 1`).
    """

    head: tuple[str, ...]
    """The first `size` waiting jobs' task ids, in fleet order."""
    known: frozenset[str]
    """Every job the ordering saw (waiting or assigned): a job not among them is new."""
    always: frozenset[str]
    """Waiting jobs decided on every pass (`always_decided`)."""

    @classmethod
    def of(cls, ordered: Sequence[PendingJob], known: Collection[str], size: int) -> Window:
        """The window of `ordered` (every waiting job, in fleet order); `known`: every
        task id the pass read, waiting or not."""
        head = tuple(job.task_id for job in ordered[:size])
        always = frozenset(job.task_id for job in ordered[size:] if always_decided(job))
        return cls(head, frozenset(known), always)

    def pick(
        self, records: Mapping[str, Mapping[str, Any]], fresh: Collection[str], depth: int
    ) -> list[str] | None:
        """The task ids a pass deciding the first `depth` jobs in order must see, from the
        pass's `records` (task id -> record with its `state`) and the ids whose record
        changed since the window was made (`fresh`); None when fewer than `depth`
        unchanged window jobs still wait while jobs outside it do: order everything again.
        """
        head = [
            i
            for i in self.head
            if i not in fresh and (records.get(i) or {}).get("state") == "pending"
        ]
        beyond = len(self.known) > len(self.head) or len(records) > len(self.known)
        if len(head) < depth and beyond:
            return None
        picked = dict.fromkeys(head)
        for group in (fresh, records.keys() - self.known, self.always):
            picked.update((i, None) for i in group if i in records)
        return list(picked)
