"""Prefetch (`ojs_ml_prefetch`): the next jobs wait at a worker's gate, ahead of capacity.

A mixin of `scheduling.FleetScheduler`, split out of it to keep modules small;
every attribute below is set by `FleetScheduler.__init__`.

Key decisions:
* Only the next jobs in fleet order planned on a worker (its reservation, then
  the shadow estimates that start there soonest, `Decision.planned`) are
  delivered ahead, at most `ojs_ml_prefetch` per worker; the gate holds them
  and starts one the moment a job there ends, with no pass between. A gate
  that starts one wakes the leader, which then sends the next. Prefetch needs
  no deeper reservations, so backfill stays as without it.
* A job delivered ahead is `assigned` in the store but still waits: the pass
  that sends it writes its annotation with `ahead`, and `explain` shows it
  waiting, with that reason, start estimate and worker. Later passes keep its
  estimate current (`ahead_estimates`): a job ending early there moves it.
* A prefetched job is never stuck behind a busy worker while another could
  run it: each pass takes back (fenced by its token) every prefetched job that
  has not started when a worker other than its holder can start it now, with
  the capacity the pass left there. It is placed again in the next pass,
  without the back-off of a job a gate gave back (`_cooled_at`).
* Only where a job is likely to start within half of `ojs_ml_max_hold_s`: its
  planned start is that close, or a job ended on that worker that recently
  (`_turning`). Elsewhere (jobs of minutes) it would be given back by the gate
  and sent again over and over, to save a few milliseconds.
* A job escalated (§8.4) is not delivered ahead: its message still carries its
  old band, which the gate orders held jobs by. It is ordered in its new band
  when the jobs already waiting at its worker's gate are checked (below).
* A job of a queue with a GPU budget (§10.3) is not delivered ahead: a budget
  counts an assigned job as holding its GPUs, so one waiting at a gate would
  use up its queue's budget. With fair-share weights a job waiting at a gate
  counts in its queue's share only from its start (`PassInputs._inflight`),
  and is sent only where its start cannot push its queue past its weighted
  share (`scheduler.fair.AheadShares`): the gate starts it at the next end
  there, whichever queue's job ends, and knows no weights.
* A job that ranks above a preemptible job running on the worker it is reserved
  on is not delivered ahead: it may preempt there once its victims have run
  `ojs_ml_min_runtime_before_preemption_s`, and only a pass plans that.
* Fleet order holds at the gate too. The gate starts what it holds as soon as
  it fits, so once a job reserved on a worker is not sent ahead (for any of the
  reasons above), no job after it in order is sent there in that pass; and a
  prefetched job is taken back when a job ahead of it in order (one published
  later in a higher band or priority) now waits for the same worker.
* A delivered job is `assigned`: RFC 27 prioritize takes it back first (fenced by
  its token), so it is placed again in its new order (`OJSML.prioritize`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

from celery_ojs_ml.allocator.model import Demand, rank
from celery_ojs_ml.leader.budget_holds import BudgetHold
from celery_ojs_ml.leader.fleet_view import pending_job
from celery_ojs_ml.matching import FreeCapacity
from celery_ojs_ml.matching.match import hard_reasons
from celery_ojs_ml.scheduler import Decision, PendingJob, Policy, Reservation, WorkerState
from celery_ojs_ml.scheduler.fair import AheadShares, held_gpus, weighted_split
from celery_ojs_ml.scheduler.order import OrderKey, order_key
from celery_ojs_ml.scheduler.settle import lowest_preemptible
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share
from celery_ojs_ml.store.pending import ASSIGNED, PendingBook

log = logging.getLogger("celery_ojs_ml.leader.loop")


class Prefetching:
    """Deliver reserved jobs ahead of capacity, and take them back when others free first."""

    settings: Any
    book: PendingBook
    _prefetched: dict[str, str]
    _ahead_notes: dict[str, tuple[str, float | None, str | None]]
    """The annotation last written for each job delivered ahead, by task id."""
    _dirty: bool
    policy: Policy
    _holds: dict[str, BudgetHold]
    """`PassInputs._holds`: every assignment of this leader under weights or budgets."""
    _pass_inflight: list[tuple[str, int]]
    """The pass's `PassInputs._inflight`: (queue, GPUs) assigned and not yet running."""

    _deliver: Callable[..., bool]
    """`FleetScheduler._deliver`."""
    _notes: Any
    """`FleetScheduler._notes`: the annotations last written, by task id."""
    _turnover: dict[str, tuple[frozenset[str], float]]
    """Per worker: its running jobs as the last pass saw them, and when one last ended."""
    parse: Callable[[Any], MLRequirements | None]
    """`Intake.parse`."""
    _pending_job: Callable[[str, dict[str, Any]], PendingJob | None]
    """`PassInputs._pending_job`: a record's parsed job, cached."""

    def _prefetch(
        self,
        decision: Decision,
        fleet: list[WorkerState],
        records: dict[str, dict[str, Any]],
        jobs: dict[str, PendingJob],
        now: float,
    ) -> None:
        """Deliver the jobs planned next on busy workers ahead of capacity (`ojs_ml_prefetch`
        per worker, see module doc): their gate starts them as soon as a job there ends."""
        waiting = self._held_ahead(records)
        room = _room(fleet, _left(decision, fleet, jobs))
        shares = self._ahead_shares(decision, fleet, records, jobs)
        turning = self._turning(fleet, now)
        horizon = float(self.settings.max_hold_s) / 2
        shut: set[str] = set()
        """Workers where a job planned earlier in order was not sent ahead: one sent after
        it would start there first (the gate starts what it holds), so none is."""
        notes: dict[str, tuple[str, float | None, str | None]] = {}
        for r in _planned(decision):
            if r.worker in shut:
                continue
            job = jobs.get(r.task_id)
            soon = r.worker in turning or (r.start is not None and r.start - now <= horizon)
            if (
                not soon
                or r.task_id in decision.escalations  # its message keeps its old band
                or not self._may_send_ahead(job, room.get(r.worker), waiting.get(r.worker, 0), now)
                or (shares is not None and not shares.admits(job, r.worker))
            ):
                shut.add(r.worker)
                continue
            assert job is not None
            waiting[r.worker] = waiting.get(r.worker, 0) + 1
            if shares is not None:
                shares.take(job, r.worker)
            if self._deliver(r.task_id, r.worker, records[r.task_id], job, (), now, prefetch=True):
                notes[r.task_id] = _ahead_note(decision, r.task_id, r.worker, r.start)
        notes |= self._moved_estimates(fleet, records, notes, now)
        if notes:  # it still waits: `explain` shows why and when, as for any waiting job
            self.book.annotate(notes, ahead=True)
            self._ahead_notes |= notes
            for task_id in notes:  # annotated afresh if it is taken back
                self._notes[task_id] = ("delivered ahead", None)

    def _ahead_shares(
        self,
        decision: Decision,
        fleet: list[WorkerState],
        records: dict[str, dict[str, Any]],
        jobs: dict[str, PendingJob],
    ) -> AheadShares | None:
        """The queues' weighted shares and holdings (`AheadShares`); None without weights.
        A queue's demand is what it holds, has held ahead and has waiting."""
        weights = dict(self.policy.weights)
        if not weights:
            return None
        held = held_gpus(fleet, self._pass_inflight)
        on: dict[str, set[str]] = {w.name: {r.queue for r in w.running} for w in fleet}
        ahead: dict[str, int] = {}
        for task_id, hold in self._holds.items():
            on.setdefault(hold.worker, set()).add(hold.queue)
            record = records.get(task_id)
            if task_id in self._prefetched and record and record.get("state") == ASSIGNED:
                ahead[hold.queue] = ahead.get(hold.queue, 0) + hold.gpus
        demand = {q: float(n) for q, n in held.items()}
        placed = {a.task_id for a in decision.assignments}
        placed |= {p.task_id for p in decision.preemptions}
        waiting: dict[str, int] = {}
        for job in jobs.values():
            if job.task_id in placed:  # assigned by this pass, after `_pass_inflight`
                held[job.queue] = held.get(job.queue, 0) + _gpus(job)
            else:
                waiting[job.queue] = waiting.get(job.queue, 0) + max(1, _gpus(job))
            demand[job.queue] = demand.get(job.queue, 0.0) + _gpus(job)
        for queue, n in ahead.items():
            demand[queue] = demand.get(queue, 0.0) + n
        total = sum(w.caps.gpu_count for w in fleet if w.available)
        return AheadShares(weighted_split(total, demand, weights), held, ahead, on, waiting)

    def _moved_estimates(
        self,
        fleet: list[WorkerState],
        records: dict[str, dict[str, Any]],
        fresh: dict[str, tuple[str, float | None, str | None]],
        now: float,
    ) -> dict[str, tuple[str, float | None, str | None]]:
        """The notes of jobs delivered ahead in earlier passes whose start estimate moved
        by more than `_MOVED_S` (`ahead_estimates`), and of those sent in this pass
        (`fresh`, with the core's planned start): the gate's order gives their estimate
        too. The core plans a job sent after another as if that one ran already, so its
        start would be one end too early until the next pass moved it (seen in CI)."""
        if not self._ahead_notes and not fresh:
            return {}
        held: dict[str, list[tuple[OrderKey, str]]] = {}
        for task_id, worker in self._prefetched.items():
            record = records.get(task_id)
            job = self._pending_job(task_id, record) if record is not None else None
            if job is not None:
                held.setdefault(worker, []).append((order_key(job), task_id))
        states = {w.name: w for w in fleet if w.name in held}
        out: dict[str, tuple[str, float | None, str | None]] = {}
        overdue = self.policy.overdue_s
        for worker, keyed in held.items():
            state = states.get(worker)
            if state is None:  # gone: the pass takes its jobs back
                continue
            ids = [t for _, t in sorted(keyed)]
            for task_id, t in ahead_estimates(state, ids, self._prefetched, now, overdue).items():
                note = fresh.get(task_id) or self._ahead_notes.get(task_id)
                if note is not None and (_moved(note[1], t) or task_id in fresh):
                    out[task_id] = (note[0], t, note[2])
        return out

    def _may_send_ahead(
        self, job: PendingJob | None, room: tuple[int, int] | None, waiting: int, now: float
    ) -> bool:
        """Whether a job planned on a worker may wait at its gate (see module doc);
        `room`: the worker's `_room`, `waiting`: the jobs already held ahead there."""
        if job is None or job.gang is not None or job.gpu_affinity == "dedicated" or not room:
            return False
        below, frees = room
        if rank(job.band) > below:
            return False  # it may preempt there once its victims are old enough: a pass decides
        if job.not_before > now:  # sitting out a give-back: not sent back at once
            return False
        if any(queue == job.queue for queue, _ in self.policy.budgets):
            return False  # waiting assigned, it would hold its queue's GPU budget (§10.3)
        gpus = int(job.req.ext_ml_gpu_count or 0)
        if gpus < 1 or gpu_share(job.req) is not None or gpus > frees:
            return False  # held at the gate, it would keep other jobs from backfilling there
        return waiting < int(self.settings.prefetch)

    def _turning(self, fleet: list[WorkerState], now: float) -> set[str]:
        """Workers where a running job ended within the last `ojs_ml_max_hold_s / 2`, as
        the passes saw their leases: a job sent there ahead is likely to start well
        before its gate gives it back (`ojs_ml_max_hold_s`). Where jobs run for minutes,
        a job sent ahead would wait there for the next end, be given back, and be sent
        again, over and over; it waits for a pass instead (a few ms against minutes)."""
        horizon = float(self.settings.max_hold_s) / 2
        out: set[str] = set()
        seen = self._turnover
        for w in fleet:
            ids = frozenset(r.task_id for r in w.running)
            before, ended = seen.get(w.name, (ids, -1e18))
            if before - ids:
                ended = now
            seen[w.name] = (ids, ended)
            if now - ended <= horizon:
                out.add(w.name)
        for name in set(seen) - {w.name for w in fleet}:
            del seen[name]
        return out

    def _held_ahead(self, records: dict[str, dict[str, Any]]) -> dict[str, int]:
        """Prefetched jobs not started yet, per worker."""
        out: dict[str, int] = {}
        for task_id, worker in list(self._prefetched.items()):
            record = records.get(task_id)
            if record is None or record.get("state") != ASSIGNED:
                del self._prefetched[task_id]
                self._ahead_notes.pop(task_id, None)
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
        first = _first_reserved(decision, jobs)
        left = _left(decision, fleet, jobs)
        for task_id, holder in held:
            record = records.get(task_id)
            if record is None or record.get("state") != ASSIGNED or record.get("worker") != holder:
                continue
            job = pending_job(task_id, record, self.parse)
            if job is None:
                continue
            ahead = first.get(holder)
            if ahead is not None and ahead[0] < order_key(job):
                why = f"{ahead[1]}, ahead of it in fleet order, waits for {holder}"
                self._take_back_held(task_id, holder, record, why)
                continue
            other = _starts_now(job, fleet, left, holder)
            if other is None:
                continue
            why = f"{other} can start it now, {holder} is still busy"
            if self._take_back_held(task_id, holder, record, why):
                left[other] = _less(left[other], Demand.of(job.req))

    def _take_back_held(self, task_id: str, holder: str, record: dict[str, Any], why: str) -> bool:
        """Take a prefetched job back from its gate (fenced by its token)."""
        if not self.book.take_back(task_id, str(record.get("token")), why, cool=False):
            return False
        log.info("ojs-ml: took prefetched %s back from %s: %s", task_id, holder, why)
        del self._prefetched[task_id]
        self._ahead_notes.pop(task_id, None)
        self._dirty = True
        return True


_MOVED_S = 0.5
"""A start estimate of a job delivered ahead is written again when it moved more."""


def ahead_estimates(
    state: WorkerState, held: Sequence[str], ahead: Collection[str], now: float, overdue_s: float
) -> dict[str, float | None]:
    """When each job held ahead at a worker's gate is likely to start; `held`: their ids
    in the gate's order, `ahead`: every job delivered ahead (their ledger entries are
    not running jobs).

    The i-th starts when the i-th of the jobs running there ends, by their time limits:
    each fits in what any one of them frees (`_may_send_ahead`), and the gate starts
    them in order. A job past its limit ends `overdue_s` from now, as in the policy
    core; past the known ends the estimate is None (unknown)."""
    ends = sorted(
        now + overdue_s if end <= now else end
        for r in state.running
        if r.task_id not in ahead and (end := r.ends_at) is not None
    )
    return {task_id: ends[i] if i < len(ends) else None for i, task_id in enumerate(held)}


def _gpus(job: PendingJob) -> int:
    return int(job.req.ext_ml_gpu_count or 0)


def _moved(old: float | None, new: float | None) -> bool:
    if old is None or new is None:
        return old is not new
    return abs(new - old) > _MOVED_S


def _left(
    decision: Decision, fleet: list[WorkerState], jobs: dict[str, PendingJob]
) -> dict[str, FreeCapacity]:
    """Each worker's free capacity less what the pass assigned there."""
    left = {w.name: w.free for w in fleet}
    for a in decision.assignments:
        job = jobs.get(a.task_id)
        if job is not None and a.worker in left:
            left[a.worker] = _less(left[a.worker], Demand.of(job.req))
    return left


def _room(fleet: list[WorkerState], left: dict[str, FreeCapacity]) -> dict[str, tuple[int, int]]:
    """Per worker where jobs may wait ahead: (the rank of its lowest preemptible running
    band, the GPUs that any one of its running jobs frees when it ends).

    Only a worker the pass left with no free GPU, and whose every running job holds
    GPUs, gets an entry: a job that fits in what any one job there frees starts at the
    first end, as a pass would start it, and holding it at the gate costs nothing.
    A job that needs more would wait there through several ends, and the gate's
    backfill rule (it knows no time limits) would keep shorter jobs off the GPUs
    freed meanwhile, which the fleet scheduler backfills (docs/scheduling.md)."""
    out: dict[str, tuple[int, int]] = {}
    for w in fleet:
        gpus = [r.gpus for r in w.running]
        if not gpus or min(gpus) < 1 or left[w.name].gpus != 0:
            continue
        out[w.name] = (lowest_preemptible(w.running), min(gpus))
    return out


def _planned(decision: Decision) -> tuple[Reservation, ...]:
    """Where waiting jobs would start soonest, in fleet order: reservations and shadow
    estimates (`Decision.planned`; a decision built with reservations only: those)."""
    return decision.planned or decision.reservations


def _ahead_note(
    decision: Decision, task_id: str, worker: str, start: float | None
) -> tuple[str, float | None, str | None]:
    """The annotation of a job delivered ahead: the pass's reason, and where it waits."""
    note = decision.annotations.get(task_id)
    reason = note.reason_pending if note is not None else "waiting for capacity"
    where = f"delivered ahead to {worker}, whose gate starts it as soon as it fits there"
    return f"{reason}; {where}", start, worker


def _first_reserved(
    decision: Decision, jobs: dict[str, PendingJob]
) -> dict[str, tuple[OrderKey, str]]:
    """Per worker, the fleet-order key and id of the first waiting job planned on it."""
    out: dict[str, tuple[OrderKey, str]] = {}
    for r in _planned(decision):
        job = jobs.get(r.task_id)
        if job is None:
            continue
        up = job.req.ext_ml_escalation_target_class
        if r.task_id in decision.escalations and up is not None:  # ordered in its new band
            job = dataclasses.replace(job, band=up)
        key = order_key(job)
        if r.worker not in out or key < out[r.worker][0]:
            out[r.worker] = (key, r.task_id)
    return out


def _starts_now(
    job: PendingJob, fleet: list[WorkerState], left: dict[str, FreeCapacity], holder: str
) -> str | None:
    """A worker other than `holder` that consumes the job's queue and fits it now, with a
    free pool process where they are counted (elsewhere it would wait in the pool's
    queue instead of at `holder`'s gate, and could not be taken back from there)."""
    for worker in fleet:
        if worker.name == holder or not worker.available or job.queue not in worker.queues:
            continue
        free = left[worker.name]
        if free.processes is not None and free.processes < 1:
            continue
        if not hard_reasons(job.req, worker.caps, free):
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
        processes=minus(free.processes, 1),
    )
