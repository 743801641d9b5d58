"""Prefetch (`ojs_ml_prefetch`): the next jobs wait at a busy worker's gate, ahead of capacity.

Key decisions:
* Only the next jobs in fleet order planned on a worker (`Decision.planned`)
  are delivered ahead, at most `ojs_ml_prefetch` per worker, and only where one
  is likely to start within half of `ojs_ml_max_hold_s`; the gate starts one
  the moment a job there ends, with no pass between. Backfill stays as without.
* Fleet order holds at the gate: a held job is taken back (fenced by its token)
  when a job ahead of it in order now waits for its worker, or when another
  worker can start it now. A job delivered ahead is `assigned` but still waits:
  its annotation says where, and later passes keep its start estimate current.
The rules, one by one, are on `Prefetch`; the pure ones in `leader.ahead`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from celery_ojs_ml.allocator.model import Demand, rank
from celery_ojs_ml.scheduler import PendingJob, Policy, WorkerState
from celery_ojs_ml.scheduler.fair import AheadShares
from celery_ojs_ml.scheduler.order import OrderKey, order_key
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share
from celery_ojs_ml.store.pending import ASSIGNED

from . import ahead as rules
from .ahead import Note, ahead_estimates
from .ahead_kept import AheadKept
from .budget_holds import BudgetHolds
from .fleet_view import pending_job
from .notes import Notes
from .pass_state import PassState

log = logging.getLogger("celery_ojs_ml.leader.loop")

__all__ = ["Prefetch", "ahead_estimates"]


Batched = Callable[[PendingJob, Mapping[str, Mapping[str, Any]]], bool]
"""Whether a job's task batches its requests, given the pass's live workers' heartbeats
(`leader.loop.batches`)."""


class Deliver(Protocol):
    """`Delivery.deliver`."""

    def __call__(
        self,
        state: PassState,
        task_id: str,
        worker: str,
        victims: tuple[str, ...] = (),
        *,
        prefetch: bool = False,
    ) -> bool: ...


class AheadBook(Protocol):
    """What prefetch writes to the pending set (`PendingBook`)."""

    def annotate(self, notes: dict[str, Note], *, ahead: bool = False) -> Any: ...

    def take_back(self, task_id: str, token: str, reason: str, *, cool: bool = True) -> bool: ...


class Prefetch:
    """Deliver planned jobs ahead of capacity; take them back when others free first.

    Rules (each pass, after its assignments):
    * Sent ahead only where one is likely to start within half of `ojs_ml_max_hold_s`
      (its planned start is that close, or a job ended there that recently:
      `_turning`); elsewhere the gate would give it back and it would be sent again.
    * Not an escalated job (§8.4): its message keeps its old band, which the gate
      orders held jobs by. Not a job of a queue with a GPU budget (§10.3): waiting
      assigned it would hold its queue's budget. With fair-share weights a job held
      ahead counts in its queue's share from its start, and is sent only where that
      start cannot push its queue past its share (`scheduler.fair.AheadShares`).
    * Not a job ranked above a preemptible job running on its worker: it may preempt
      there once its victims are old enough, and only a pass plans that.
    * Once a job planned on a worker is not sent ahead, none after it in order is
      sent there in that pass (the gate starts what it holds as soon as it fits).
    * Behind the last job a pass sends to a worker where jobs turn over, the jobs right
      after it in fleet order follow it, while of its class (`_follow_on`), where no
      other worker could run that class, and without fair-share weights.
    * A worker's running jobs include those its heartbeat shows allocated without a
      lease yet (`ahead.shown_running`): a short job ends before its lease is written.
    * A held job taken back is placed again by the next pass without the give-back
      back-off; RFC 27 prioritize takes it back first (`OJSML.prioritize`).
    """

    def __init__(
        self,
        settings: Any,
        policy: Policy,
        book: AheadBook,
        deliver: Deliver,
        holds: BudgetHolds,
        notes: Notes,
        parse: Callable[[Any], MLRequirements | None],
        job_of: Callable[[str, dict[str, Any]], PendingJob | None],
        batched: Batched = lambda job, live: False,
    ) -> None:
        self.settings = settings
        self.batched = batched
        """Whether a job's task batches (`ml_batch`), in the leader's task registry or as
        the pass's live workers advertise it (`info.batching`): its jobs reach their worker
        by its grant and its own queue, where a batch fills up to its `max_size`
        (`worker/batching.py`), so none follows on (`_follow_on`); followed on a prefetch
        window at a time, they ran in batches of two."""
        self.policy = policy
        self.book = book
        self.deliver = deliver
        self.holds = holds
        self.notes = notes
        self.parse = parse
        self.job_of = job_of
        """A record's parsed job, cached (`PassInputs.job`)."""
        self.sent: dict[str, str] = {}
        """Jobs delivered ahead -> their worker, until started."""
        self.ahead_notes: dict[str, Note] = {}
        """The annotation last written for each job delivered ahead."""
        self.turnover: dict[str, tuple[frozenset[str], float]] = {}
        """Per worker: its running jobs as the last pass saw them, and when one last ended."""
        self.kept = AheadKept()
        """Per worker, its shown jobs, `room` entry and running ids, kept while unchanged."""

    def send_ahead(self, state: PassState) -> None:
        """Deliver the jobs planned next on busy workers ahead of capacity (see the class
        doc): their gate starts them as soon as a job there ends."""
        notes = self._send(state)
        notes |= self._moved_estimates(state, notes)
        if notes:  # it still waits: `explain` shows why and when, as for any waiting job
            self.book.annotate(notes, ahead=True)
            self.ahead_notes |= notes
            self.notes.delivered_ahead(list(notes))

    def _send(self, state: PassState) -> dict[str, Note]:
        decision, fleet, jobs, now = state.decision, state.fleet, state.jobs, state.now
        waiting = self._held_ahead(state.records)
        left = rules.left_after(decision, fleet, jobs)
        self.kept.shown(fleet, state.live)
        room = self.kept.room(fleet, left, rules.assigned_jobs(decision, jobs))
        shares = self._ahead_shares(state)
        turning = self._turning(fleet, now)
        horizon = float(self.settings.max_hold_s) / 2
        shut: set[str] = set()
        """Workers where a job planned earlier in order was not sent ahead: one sent after
        it would start there first (the gate starts what it holds), so none is."""
        last: dict[str, str] = {}
        """Per worker, the last job this pass sent there ahead."""
        notes: dict[str, Note] = {}
        for r in rules.planned(decision):
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
            if shares is not None:
                shares.take(job, r.worker)
            if self._ahead(state, r.task_id, r.worker, r.start, waiting, notes):
                last[r.worker] = r.task_id
        if shares is None:  # with weights the core orders by share: no follow-on
            runs = {w: t for w, t in last.items() if w not in shut and w in turning}
            self._follow_on(state, runs, room, waiting, notes)
        return notes

    def _ahead(
        self,
        state: PassState,
        task_id: str,
        worker: str,
        start: float | None,
        waiting: dict[str, int],
        notes: dict[str, Note],
    ) -> bool:
        """Deliver one job ahead to `worker`; False where it was not pending any more."""
        waiting[worker] = waiting.get(worker, 0) + 1
        if not self.deliver(state, task_id, worker, prefetch=True):
            return False
        self.sent[task_id] = worker
        notes[task_id] = rules.ahead_note(state.decision, task_id, worker, start)
        return True

    def _follow_on(
        self,
        state: PassState,
        runs: dict[str, str],
        room: dict[str, tuple[int, int]],
        waiting: dict[str, int],
        notes: dict[str, Note],
    ) -> None:
        """After the last job this pass sent ahead to a turning worker (`runs`; only where
        no other worker could run its class, `ahead.only_worker`), the jobs right behind
        it in fleet order, while they are of its class (`ahead.follows`), planned nowhere,
        and may wait there (`_may_send_ahead`); not for a task that batches (`batched`).
        The core plans only the first blocked job
        where time limits are unknown: one pass would otherwise send one job ahead per
        worker, and a worker whose jobs end faster than passes come would wait for the
        next pass between two of them."""
        if not runs:
            return
        decision, jobs = state.decision, state.jobs
        kinds: dict[str, bool] = {}  # batched, by task name: each reads every heartbeat
        sole = {w: f for w, f in runs.items() if self._leads(state, w, jobs[f], kinds)}
        if not sole:
            return  # the ordering below sorts every waiting job: only when one may follow
        after = rules.next_waiting(decision, jobs)
        planned = {r.task_id for r in rules.planned(decision)}
        for worker, first in sole.items():
            task_id = after.get(first)
            while task_id is not None and task_id not in planned:
                job = jobs[task_id]
                if (
                    not rules.follows(jobs[first], job)
                    or task_id in decision.escalations
                    or not self._may_send_ahead(
                        job, room.get(worker), waiting.get(worker, 0), state.now
                    )
                    or not self._ahead(state, task_id, worker, None, waiting, notes)
                ):
                    break
                task_id = after.get(task_id)

    def _leads(
        self, state: PassState, worker: str, first: PendingJob, kinds: dict[str, bool]
    ) -> bool:
        """Whether jobs may follow `first` to `worker`: its task does not batch (`kinds`
        keeps the answer by task name for the pass), and no other worker could run its
        class (`ahead.only_worker`)."""
        name = first.labels.get("job_type", "")
        batched = kinds.get(name)
        if batched is None:
            batched = kinds[name] = self.batched(first, state.live)
        return not batched and rules.only_worker(first, state.fleet, worker)

    def _ahead_shares(self, state: PassState) -> AheadShares | None:
        """The queues' weighted shares and holdings; None without fair-share weights."""
        weights = dict(self.policy.weights)
        if not weights:
            return None
        return rules.ahead_shares(
            state.decision,
            state.fleet,
            state.records,
            state.jobs,
            weights,
            self.holds.holds,
            self.sent,
            state.inflight,
            state.usage,
        )

    def _moved_estimates(self, state: PassState, fresh: dict[str, Note]) -> dict[str, Note]:
        """The notes of jobs delivered ahead in earlier passes whose start estimate moved
        (`ahead.moved`), and of those sent in this pass (`fresh`, with the core's planned
        start): the gate's order gives their estimate too. The core plans a job sent after
        another as if that one ran already, so its start would be one end too early."""
        if not self.ahead_notes and not fresh:
            return {}
        held: dict[str, list[tuple[OrderKey, str]]] = {}
        for task_id, worker in self.sent.items():
            record = state.records.get(task_id)
            job = self.job_of(task_id, record) if record is not None else None
            if job is not None:
                held.setdefault(worker, []).append((order_key(job), task_id))
        states = {w.name: w for w in state.fleet if w.name in held}
        out: dict[str, Note] = {}
        overdue = self.policy.overdue_s
        for worker, keyed in held.items():
            found = states.get(worker)
            if found is None:  # gone: the pass takes its jobs back
                continue
            ids = [t for _, t in sorted(keyed)]
            for task_id, t in ahead_estimates(found, ids, self.sent, state.now, overdue).items():
                note = fresh.get(task_id) or self.ahead_notes.get(task_id)
                if note is not None and (rules.moved(note[1], t) or task_id in fresh):
                    out[task_id] = (note[0], t, note[2])
        return out

    def _may_send_ahead(
        self, job: PendingJob | None, room: tuple[int, int] | None, waiting: int, now: float
    ) -> bool:
        """Whether a job planned on a worker may wait at its gate (see the class doc);
        `room`: the worker's `ahead.room`, `waiting`: the jobs already held ahead there."""
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
        the passes saw their leases and heartbeats (`shown`: jobs without a lease yet):
        a job sent there ahead is likely to start well before its gate gives it back.
        Where jobs run for minutes, a job sent ahead would wait for the next end, be
        given back, and be sent again, over and over."""
        horizon = float(self.settings.max_hold_s) / 2
        out: set[str] = set()
        seen = self.turnover
        for w in fleet:
            ids = self.kept.running_ids(w)
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
        for task_id, worker in list(self.sent.items()):
            record = records.get(task_id)
            if record is None or record.get("state") != ASSIGNED:
                del self.sent[task_id]
                self.ahead_notes.pop(task_id, None)
            else:
                out[worker] = out.get(worker, 0) + 1
        return out

    def unhold(self, state: PassState) -> None:
        """Take back prefetched jobs that another worker can start now, or that a job
        ahead of them in fleet order now waits behind (see the module doc)."""
        held = [(t, w) for t, w in self.sent.items() if t not in state.jobs]
        if not held:
            return
        first = rules.first_reserved(state.decision, state.jobs)
        left = rules.left_after(state.decision, state.fleet, state.jobs)
        for task_id, holder in held:
            record = state.records.get(task_id)
            if record is None or record.get("state") != ASSIGNED or record.get("worker") != holder:
                continue
            job = pending_job(task_id, record, self.parse)
            if job is None:
                continue
            ahead = first.get(holder)
            if ahead is not None and ahead[0] < order_key(job):
                why = f"{ahead[1]}, ahead of it in fleet order, waits for {holder}"
                self._take_back(state, task_id, holder, record, why)
                continue
            other = rules.starts_now(job, state.fleet, left, holder)
            if other is None:
                continue
            why = f"{other} can start it now, {holder} is still busy"
            if self._take_back(state, task_id, holder, record, why):
                left[other] = rules.less(left[other], Demand.of(job.req))

    def _take_back(
        self, state: PassState, task_id: str, holder: str, record: dict[str, Any], why: str
    ) -> bool:
        """Take a prefetched job back from its gate (fenced by its token)."""
        if not self.book.take_back(task_id, str(record.get("token")), why, cool=False):
            return False
        log.info("ojs-ml: took prefetched %s back from %s: %s", task_id, holder, why)
        del self.sent[task_id]
        self.ahead_notes.pop(task_id, None)
        state.dirty = True
        return True
