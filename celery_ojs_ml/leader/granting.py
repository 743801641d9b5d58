"""The leader's side of grants: issue them after quiet passes, revoke them, take jobs back.

A mixin of `scheduling.FleetScheduler`, split out of it to keep modules small; every
attribute below is set by `FleetScheduler.__init__` or its other mixins.
`scheduler.grants` says what a grant is and when one is made.

Key decisions:
* A pass that leaves a job waiting (or preempts, denies or reserves for it) revokes the
  grants of every worker that job could use (`scheduler.grants.contested`), before its
  assignments go out: there, the fleet is back to one decision per job, in fleet order.
  A held reservation revokes every grant. Revoking deletes the grants (publishers stop
  sending there) and then moves the jobs still queued on each holder back to the
  intake in one Lua call (`redis_intake.sweep_granted`); the holder gives back the ones
  it already took but did not start (`worker.granted`). The next pass orders them
  with the rest.
* A holder that left is revoked at the first pass that misses it; the granted jobs it
  had taken off its queue are in kombu's unacked hash, and go back to the intake once
  it has been gone `ojs_ml_lease_ttl_s` (`redis_intake.restore_granted`): that is when
  its leases are taken over too, so a worker that only stalled is treated alike.
* A holder with jobs queued (or held at its gate) while another worker could start one
  of the class now is revoked too: a grant never keeps a job waiting that a pass would
  start elsewhere. So is one whose oldest queued granted job has waited longer than
  `ojs_ml_grant_wait_s` (the publish time rides in header `ojs_grant_at`): a job that
  waits that long is the scheduler's to order, annotate and place, as any other.
* A new leader reads the grants in the store (RFC 27 `hello`) and keeps them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery_ojs_ml.leader.delivery import HEADER_ASSIGN
from celery_ojs_ml.scheduler import Decision, PendingJob, Policy, WorkerState, schedule
from celery_ojs_ml.scheduler.grants import contested, foreign, grants_after, to_revoke
from celery_ojs_ml.store import broker as redis_intake
from celery_ojs_ml.store.grants import (
    HEADER_GRANT,
    HEADER_GRANT_AT,
    GrantBook,
    grants_usable,
)
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.queues import worker_queue_name
from celery_ojs_ml.wire.settings import OJSMLSettings

log = logging.getLogger(__name__)


class Granting:
    """`_grant_after`, `_tend_grants`, `revoke_grants` (see module doc)."""

    app: Any
    settings: OJSMLSettings
    store: OJSStore
    policy: Policy
    intake: str
    _direct: Any
    _dirty: bool
    _granted: dict[str, tuple[str, str]]
    """field -> (worker, epoch) of every grant, as this leader wrote or found them."""
    _grant_jobs: dict[str, PendingJob]
    """field -> the job whose placement made the grant (probes where else the class fits)."""
    _gone: dict[str, float]
    """Holders that left -> when this leader missed them first (`restore_granted`)."""
    _grants_on: bool | None

    def _holders(self) -> dict[str, str]:
        """field -> holder of every grant."""
        return {f: w for f, (w, _) in self._granted.items()}

    def _grants_usable(self) -> bool:
        if self._grants_on is None:
            self._grants_on = grants_usable(self.app) and not self.policy.counts_assignments
        return self._grants_on and self._direct is not None

    def _hello_grants(self) -> None:
        """A new leader keeps the grants it finds (their holders run their jobs)."""
        self._granted, self._grant_jobs, self._gone = {}, {}, {}
        try:
            self._granted = GrantBook(self.store).all()
        except Exception as exc:
            log.warning("ojs-ml: could not read the grants: %s", exc)

    def _contested(
        self,
        decision: Decision,
        jobs: dict[str, PendingJob],
        fleet: list[WorkerState],
        records: dict[str, Any],
    ) -> frozenset[str] | None:
        """`scheduler.grants.contested` over the workers that matter: the holders and the
        workers the pass assigned to (frozenset() at no cost where grants are off)."""
        if not self._grants_usable():
            return frozenset()
        names = {w for w, _ in self._granted.values()} | {a.worker for a in decision.assignments}
        if not names:
            return frozenset()
        waiting = sum(1 for r in records.values() if r.get("state") == "pending")
        return contested(decision, jobs, [w for w in fleet if w.name in names], waiting)

    def _revoke_contested(
        self,
        blocked: frozenset[str] | None,
        reserving: bool,
        decision: Decision,
        jobs: dict[str, PendingJob],
    ) -> None:
        """Before a pass's decisions go out: revoke the grants of the workers a job it left
        waiting could use (`scheduler.grants.contested`; every grant while a reservation
        is held), and of those it assigns a job of another class to (`foreign`)."""
        if not self._granted or not self._grants_usable():
            return
        held = self._holders()
        hit = foreign(decision, jobs, held)
        gone = [
            f
            for f, worker in held.items()
            if reserving or blocked is None or worker in blocked or worker in hit
        ]
        self.revoke_grants(gone)

    def _lane_blocked(self, decision: Decision, jobs: dict[str, PendingJob]) -> bool:
        """Whether the fast lane must leave these arrivals to a full pass: it would assign
        one to a grant holder behind the granted backlog (`foreign`)."""
        if not self._granted:
            return False
        return bool(foreign(decision, jobs, self._holders()))

    def _grant_after(
        self,
        decision: Decision,
        jobs: dict[str, PendingJob],
        blocked: frozenset[str] | None,
        reserving: bool,
        fleet: list[WorkerState],
    ) -> None:
        """After a pass's assignments went out: grant each class it started on a worker no
        waiting job could use to that worker (`scheduler.grants.grants_after`)."""
        if reserving or not self._grants_usable():
            return
        held = self._holders()
        new = grants_after(decision, jobs, held, blocked, fleet)
        if not new:
            return
        written = GrantBook(self.store).issue(new)
        self._granted.update(written)
        for a in decision.assignments:
            job = jobs.get(a.task_id)
            for field, worker in new.items():
                if job is not None and worker == a.worker:
                    self._grant_jobs.setdefault(field, job)
        for field, (worker, _) in written.items():
            log.info("ojs-ml: granted %s to %s", field, worker)

    def _tend_grants(self, live: dict[str, Any], fleet: list[WorkerState] | None) -> None:
        """Revoke the grants of holders that left, or that have jobs queued while another
        worker could start one of the class now; restore a departed holder's taken jobs."""
        if not self._grants_usable():
            return
        now = time.monotonic()
        for worker in [w for w in self._gone if w in live]:
            del self._gone[worker]
        if self._granted:  # ended from outside (`grants.end_grants_of`): take jobs back
            stored = GrantBook(self.store).all()
            self.revoke_grants([f for f, g in self._granted.items() if stored.get(f) != g])
        if self._granted:
            backlog, stale = self._backlogs(live)
            room = {f: self._room_elsewhere(f, fleet, backlog) for f in self._granted}
            gone = to_revoke(self._holders(), list(live), backlog, room, stale)
            for field in gone:
                worker = self._granted[field][0]
                if worker not in live:
                    self._gone.setdefault(worker, now)
            self.revoke_grants(gone)
        for worker, since in list(self._gone.items()):
            if now - since >= self.settings.lease_ttl_s:
                del self._gone[worker]
                self._restore(worker)

    def _backlogs(self, live: dict[str, Any]) -> tuple[dict[str, int], frozenset[str]]:
        """Jobs waiting on each live holder (queued, or at the worker: `_at_worker`), and
        the holders whose oldest job sent under a grant has waited longer than
        `ojs_ml_grant_wait_s` while the holder started none for as long (`_stalled`;
        queued here; the gate gives back its own)."""
        holders = sorted({w for w, _ in self._granted.values() if w in live})
        queues = [worker_queue_name(self.settings.store_prefix, w) for w in holders]
        client = self.store.client
        counts = redis_intake.backlog(client, self._direct, queues)
        since = redis_intake.oldest(client, self._direct, queues, HEADER_GRANT_AT)
        wait_s = self.settings.grant_wait_s
        backlog: dict[str, int] = {}
        stale: set[str] = set()
        for worker, queue in zip(holders, queues, strict=True):
            backlog[worker] = counts[queue] + _at_worker(live[worker])
            at = since[queue]
            if at is not None and _stalled(live[worker], at, wait_s):
                stale.add(worker)
        return backlog, frozenset(stale)

    def _room_elsewhere(
        self, field: str, fleet: list[WorkerState] | None, backlog: dict[str, int]
    ) -> bool:
        worker = self._granted[field][0]
        job = self._grant_jobs.get(field)
        if fleet is None or job is None or not backlog.get(worker):
            return False
        others = [w for w in fleet if w.name != worker]
        return bool(others and schedule([job], others, time.time(), self.policy).assignments)

    def revoke_grants(self, fields: list[str]) -> None:
        """End these grants and take the jobs queued under them back to the intake."""
        if not fields:
            return
        GrantBook(self.store).revoke(fields)
        holders = {self._granted[f][0] for f in fields if f in self._granted}
        for field in fields:
            self._granted.pop(field, None)
            self._grant_jobs.pop(field, None)
        moved = 0
        for worker in sorted(holders):
            queue = worker_queue_name(self.settings.store_prefix, worker)
            moved += redis_intake.sweep_granted(
                self.store.client, self._direct, queue, self.intake, HEADER_GRANT, HEADER_ASSIGN
            )
        self._dirty = self._dirty or moved > 0
        log.info("ojs-ml: revoked %d grants; %d queued jobs back to the intake", len(fields), moved)

    def _restore(self, worker: str) -> None:
        queue = worker_queue_name(self.settings.store_prefix, worker)
        moved = redis_intake.restore_granted(
            self.store.client, self._direct, queue, self.intake, HEADER_GRANT, HEADER_ASSIGN
        )
        if moved:
            self._dirty = True
            log.warning(
                "ojs-ml: %d granted jobs that %s had taken went back to the intake", moved, worker
            )


def _at_worker(entry: dict[str, Any]) -> int:
    """Jobs waiting at a worker as its last heartbeat shows: held at its gate, or started
    there but waiting in its pool for a process (ML jobs and plain tasks beyond it)."""
    snap = entry.get("free") or {}
    info = entry.get("info") or {}
    held = len(snap.get("held") or [])
    processes = info.get("processes")
    if not isinstance(processes, int):
        return held
    running = len(snap.get("allocations") or []) + int(info.get("plain_running") or 0)
    return held + max(0, running - processes)


def _stalled(entry: dict[str, Any], oldest: float, wait_s: float) -> bool:
    """Whether a holder's last heartbeat shows it blocked: sent `wait_s` after the oldest
    waiting job's publish (`oldest`), with no job started under a grant for `wait_s` by
    then. One heartbeat is the evidence for both: an older one, from before the jobs
    came, says nothing about whether the holder drains them."""
    ts = float(entry.get("ts") or 0.0)
    if ts - oldest <= wait_s:
        return False
    started = (entry.get("info") or {}).get("granted_started")
    return not isinstance(started, int | float) or ts - started > wait_s
