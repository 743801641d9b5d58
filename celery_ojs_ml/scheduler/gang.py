"""Gang placement (Flux RFC 25 `node>slot`): every rank of a multi-worker job at once, or none.

Key decisions:
- Gangs are decided before single jobs in each pass, in fleet order of their
  first rank, against the fleet as it is; single jobs then see what the gangs
  took. A gang is assigned only when every rank fits now on a distinct eligible
  worker (`_fit`), so no rank ever runs while another waits.
- A gang that does not fit waits whole, with one reason for all its ranks.
  It holds no backfill reservation (a known limit: under a steady stream of
  small jobs a large gang can wait long; see docs/scheduling.md).
- A gang with ranks missing from the pending set (one still running, or
  being torn down) waits until every rank is back: ranks are placed as a set.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from celery_ojs_ml.allocator.model import Demand
from celery_ojs_ml.matching import Verdict, match
from celery_ojs_ml.scheduler.model import (
    Annotation,
    Assignment,
    PendingJob,
    RunningJob,
    WorkerState,
)
from celery_ojs_ml.scheduler.order import in_order
from celery_ojs_ml.scheduler.pools import less_free


@dataclass
class Ganged:
    """What the gang pre-pass decided, and the fleet it leaves to single jobs."""

    assignments: list[Assignment]
    annotations: dict[str, Annotation]
    fleet: list[WorkerState]


def place_gangs(jobs: Iterable[PendingJob], fleet: Sequence[WorkerState], now: float) -> Ganged:
    """All-or-nothing placement of every complete gang among `jobs` (see module doc)."""
    gangs: dict[str, list[PendingJob]] = {}
    for job in in_order(jobs):
        gangs.setdefault(str(job.gang), []).append(job)
    out = Ganged([], {}, list(fleet))
    for gid, ranks in gangs.items():
        size = ranks[0].gang_size
        if len({j.rank for j in ranks}) < size:
            _wait(
                out, gid, ranks, f"{len(ranks)}/{size} ranks are waiting; the rest must end first"
            )
            continue
        found = _fit(sorted(ranks, key=lambda j: j.rank)[:size], out.fleet, now)
        if isinstance(found, str):
            _wait(out, gid, ranks, found)
            continue
        for job, (idx, state) in found:
            out.fleet[idx] = state
            out.assignments.append(Assignment(job.task_id, state.name, 100.0))
    return out


def _fit(
    ranks: list[PendingJob], fleet: list[WorkerState], now: float
) -> list[tuple[PendingJob, tuple[int, WorkerState]]] | str:
    """Each rank on its own worker, or why not.

    Best fit per rank: a worker with a free pool process first, then the one left with
    the fewest free GPUs, so no rank waits for capacity (or, where processes are
    reported, for a process)."""
    used: set[str] = set()
    chosen: list[tuple[PendingJob, tuple[int, WorkerState]]] = []
    for job in ranks:
        best: tuple[bool, int, int] | None = None
        for idx, w in enumerate(fleet):
            if w.name in used or not w.available or job.queue not in w.queues:
                continue
            if match(job.req, w.caps, w.free).verdict is not Verdict.FITS:
                continue
            left = (w.free.gpus or 0) - int(job.req.ext_ml_gpu_count or 0)
            busy = w.free.processes is not None and w.free.processes < 1
            if best is None or (busy, left) < best[:2]:
                best = (busy, left, idx)
        if best is None:
            return (
                f"{len(chosen)}/{len(ranks)} ranks can be placed now on distinct workers; "
                "a gang starts all ranks at once or none (Flux RFC 25 node>slot)"
            )
        w = fleet[best[2]]
        used.add(w.name)
        taken = RunningJob.of(job.task_id, job.req, now, queue=job.queue, labels=job.labels)
        state = replace(w, free=less_free(w.free, Demand.of(job.req)), running=(*w.running, taken))
        chosen.append((job, (best[2], state)))
    return chosen


def _wait(out: Ganged, gid: str, ranks: list[PendingJob], why: str) -> None:
    for job in ranks:
        note = f"gang {gid}: {why}"
        out.annotations[job.task_id] = Annotation(job.task_id, note, None, None)
