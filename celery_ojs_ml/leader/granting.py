"""The leader's side of grants: issue them after passes, revoke them, take jobs back.

`scheduler.grants` says what a grant is and when one is made (the policy);
this module carries it out against the store and the broker.

Key decision: a grant never keeps a job waiting that a pass would start
elsewhere. A pass that leaves a job waiting revokes the grants of every worker
that job could use before its assignments go out, and so does a holder that
left, stalled, or has jobs queued while another worker could start one; the
jobs queued under a revoked grant go back to the intake (`store.broker`).
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

from celery_ojs_ml.scheduler import PendingJob, Policy, WorkerState, schedule
from celery_ojs_ml.scheduler.grants import contested, foreign, grants_after, to_revoke
from celery_ojs_ml.store import broker, granted_jobs
from celery_ojs_ml.store.grants import GrantBook, grants_usable
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.queues import worker_queue_name

from .link import BrokerLink
from .pass_state import PassState

log = logging.getLogger(__name__)


class Granting:
    """Grants as this leader wrote or found them, and the passes' work on them.

    * A pass that leaves a job waiting (or preempts, denies or reserves for it)
      revokes the grants of every worker that job could use
      (`scheduler.grants.contested`), and a held reservation every grant. Revoking
      deletes the grants (publishers stop sending there), then moves the jobs still
      queued on each holder back to the intake in one Lua call; the holder gives back
      the ones it took but did not start (`worker.granted`).
    * A holder that left is revoked at the first pass that misses it; the granted
      jobs it had taken go back to the intake once it has been gone
      `ojs_ml_lease_ttl_s`, when its leases are taken over too.
    * A holder whose oldest queued granted job has waited longer than
      `ojs_ml_grant_wait_s` (header `ojs_grant_at`) while it started none is revoked.
    * A new leader reads the grants in the store (RFC 27 `hello`) and keeps them.
    """

    def __init__(
        self, app: Any, settings: Any, store: OJSStore, policy: Policy, link: BrokerLink
    ) -> None:
        self.app = app
        self.settings = settings
        self.store = store
        self.policy = policy
        self.link = link
        self.granted: dict[str, tuple[str, str]] = {}
        """field -> (worker, epoch) of every grant, as this leader wrote or found them."""
        self.jobs: dict[str, PendingJob] = {}
        """field -> the job whose placement made the grant (probes where else the class fits)."""
        self.gone: dict[str, float] = {}
        """Holders that left -> when this leader missed them first (`broker.restore_granted`)."""
        self._on: bool | None = None
        self.left_since: dict[str, float] = {}
        """Departed holders with granted records -> when this leader missed them first."""
        self._left_read = 0.0

    def holders(self) -> dict[str, str]:
        """field -> holder of every grant."""
        return {f: w for f, (w, _) in self.granted.items()}

    def usable(self) -> bool:
        """Whether this leader grants: the store allows it, no budget or fair-share
        weight needs every assignment counted, and the broker is the store's Redis."""
        if self._on is None:
            self._on = grants_usable(self.app) and not self.policy.counts_assignments
        return self._on and self.link.direct is not None

    def hello(self) -> None:
        """A new leader keeps the grants it finds (their holders run their jobs)."""
        self.granted, self.jobs, self.gone = {}, {}, {}
        try:
            self.granted = GrantBook(self.store).all()
        except Exception as exc:
            log.warning("ojs-ml: could not read the grants: %s", exc)

    def contested(self, state: PassState) -> frozenset[str] | None:
        """`scheduler.grants.contested` over the workers that matter: the holders and the
        workers the pass assigned to (frozenset() at no cost where grants are off)."""
        if not self.usable():
            return frozenset()
        decision = state.decision
        names = {w for w, _ in self.granted.values()} | {a.worker for a in decision.assignments}
        if not names:
            return frozenset()
        waiting = sum(1 for r in state.records.values() if r.get("state") == "pending")
        return contested(decision, state.jobs, [w for w in state.fleet if w.name in names], waiting)

    def revoke_contested(self, state: PassState) -> None:
        """Before a pass's decisions go out: revoke the grants of the workers a job it left
        waiting could use (`state.blocked`; every grant while a reservation is held), and
        of those it assigns a job of another class to (`foreign`)."""
        if not self.granted or not self.usable():
            return
        held = self.holders()
        hit = foreign(state.decision, state.jobs, held)
        blocked = state.blocked
        gone = [
            f
            for f, worker in held.items()
            if state.reserving or blocked is None or worker in blocked or worker in hit
        ]
        state.dirty |= self.revoke(gone)

    def lane_blocked(self, state: PassState) -> bool:
        """Whether the fast lane must leave these arrivals to a full pass: it would assign
        one to a grant holder behind the granted backlog (`foreign`)."""
        if not self.granted:
            return False
        return bool(foreign(state.decision, state.jobs, self.holders()))

    def grant_after(self, state: PassState) -> None:
        """After a pass's assignments went out: grant each class it started on a worker no
        waiting job could use to that worker (`scheduler.grants.grants_after`)."""
        if state.reserving or not self.usable():
            return
        held = self.holders()
        new = grants_after(state.decision, state.jobs, held, state.blocked, state.fleet)
        if not new:
            return
        written = GrantBook(self.store).issue(new)
        self.granted.update(written)
        for a in state.decision.assignments:
            job = state.jobs.get(a.task_id)
            for field, worker in new.items():
                if job is not None and worker == a.worker:
                    self.jobs.setdefault(field, job)
        for field, (worker, _) in written.items():
            log.info("ojs-ml: granted %s to %s", field, worker)

    def tend(self, state: PassState, fleet: list[WorkerState] | None) -> None:
        """Revoke the grants of holders that left, or that have jobs queued while another
        worker could start one of the class now; restore a departed holder's taken jobs."""
        if not self.usable():
            return
        now, live = time.monotonic(), state.live
        for worker in [w for w in self.gone if w in live]:
            del self.gone[worker]
        if self.granted:  # ended from outside (`grants.end_grants_of`): take jobs back
            stored = GrantBook(self.store).all()
            state.dirty |= self.revoke([f for f, g in self.granted.items() if stored.get(f) != g])
        if self.granted:
            backlog, stale = self._backlogs(live)
            room = {f: self._room_elsewhere(f, fleet, backlog) for f in self.granted}
            gone = to_revoke(self.holders(), list(live), backlog, room, stale)
            for field in gone:
                worker = self.granted[field][0]
                if worker not in live:
                    self.gone.setdefault(worker, now)
            state.dirty |= self.revoke(gone)
        for worker, since in list(self.gone.items()):
            if now - since >= self.settings.lease_ttl_s:
                del self.gone[worker]
                state.dirty |= self._restore(worker)
        state.dirty |= self.readmit_left(live)

    def _backlogs(self, live: dict[str, Any]) -> tuple[dict[str, int], frozenset[str]]:
        """Jobs waiting on each live holder (queued, or at the worker: `_at_worker`), and
        the holders whose oldest job sent under a grant has waited longer than
        `ojs_ml_grant_wait_s` while the holder started none for as long (`_stalled`;
        queued here; the gate gives back its own)."""
        holders = sorted({w for w, _ in self.granted.values() if w in live})
        queues = [worker_queue_name(self.settings.store_prefix, w) for w in holders]
        client, direct = self.store.client, self.link.direct
        counts = broker.backlog(client, direct, queues)
        since = broker.oldest(client, direct, queues, h.GRANT_AT)
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
        worker = self.granted[field][0]
        job = self.jobs.get(field)
        if fleet is None or job is None or not backlog.get(worker):
            return False
        others = [w for w in fleet if w.name != worker]
        return bool(others and schedule([job], others, time.time(), self.policy).assignments)

    def revoke(self, fields: list[str]) -> bool:
        """End these grants and take the jobs queued under them back to the intake;
        True when some moved (the next step passes at once)."""
        if not fields:
            return False
        GrantBook(self.store).revoke(fields)
        holders = {self.granted[f][0] for f in fields if f in self.granted}
        for field in fields:
            self.granted.pop(field, None)
            self.jobs.pop(field, None)
        moved = 0
        for worker in sorted(holders):
            moved += broker.sweep_granted(
                self.store.client, self.link.direct, self._queue(worker), self.link.queue,
                h.GRANT, h.ASSIGN,
            )  # fmt: skip
        log.info("ojs-ml: revoked %d grants; %d queued jobs back to the intake", len(fields), moved)
        return moved > 0

    def _restore(self, worker: str) -> bool:
        moved = broker.restore_granted(
            self.store.client, self.link.direct, self._queue(worker), self.link.queue,
            h.GRANT, h.ASSIGN,
        )  # fmt: skip
        if moved:
            log.warning(
                "ojs-ml: %d granted jobs that %s had taken went back to the intake", moved, worker
            )
        return bool(moved)

    def readmit_left(self, live: Any) -> bool:
        """At most every second: the jobs recorded for a holder gone `ojs_ml_lease_ttl_s`
        go back to the intake (`_readmit_left`); True when some did."""
        now = time.monotonic()
        if now - self._left_read < 1.0:
            return False
        self._left_read, moved = now, 0
        recorded = granted_jobs.holders(self.store)
        for worker in [w for w in self.left_since if w in live or w not in recorded]:
            del self.left_since[worker]
        for worker in sorted(recorded.difference(live)):
            if now - self.left_since.setdefault(worker, now) >= self.settings.lease_ttl_s:
                moved += self._readmit_left(worker)
                if granted_jobs.drop_holder(self.store, worker):
                    del self.left_since[worker]
        return moved > 0

    def _readmit_left(self, worker: str) -> int:
        """Send back to the intake the granted jobs a departed holder never took up
        (`store.granted_jobs`): taken off its queue by a `BRPOP` whose process died
        before kombu recorded them unacked. A copy also restored from its lists or
        kombu's unacked hash is admitted once (`ojs_msg`)."""
        left = granted_jobs.left_by(self.store, worker)
        for task_id, msg in left:
            body = base64.b64decode(msg["body"])
            key, raw = broker.envelope(
                self.link.direct, self.link.queue, body, msg["headers"],
                msg.get("properties") or {}, msg.get("content_type") or "application/json",
                msg.get("content_encoding") or "utf-8",
            )  # fmt: skip
            self.store.client.lpush(key, raw)
            log.warning(
                "ojs-ml: %s left granted job %s untaken; back to the intake", worker, task_id
            )
        granted_jobs.forget(self.store, worker, [task_id for task_id, _ in left])
        return len(left)

    def _queue(self, worker: str) -> str:
        return worker_queue_name(self.settings.store_prefix, worker)


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
