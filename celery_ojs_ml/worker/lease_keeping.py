"""The worker's lease keeping (DESIGN decision 4): write, ack, refresh, fence, recover.

Key decisions:
* The lease is written before the message is acked; if it cannot be written
  the message stays unacked until the job ends, so the broker still holds it.
* A worker whose lease was taken over (it stalled past the TTL) kills its
  own copy at once (fencing); the copy that took over is the one that counts.
* A claimed lease of a dead worker is re-published with the same task id and
  its last committed checkpoint, or dead-lettered after `ojs_ml_max_crashes`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from billiard.exceptions import Terminated
from celery import Celery
from celery.exceptions import Ignore, Reject, Retry
from celery.worker import state as worker_state

from celery_ojs_ml.allocator import Allocation, Allocator
from celery_ojs_ml.checkpoint.preempt import clear_preemption
from celery_ojs_ml.errors import ThresholdsNotMet
from celery_ojs_ml.store import granted_jobs
from celery_ojs_ml.store.deadletter import dead_letter, last_checkpoint_of
from celery_ojs_ml.store.leases import LeaseBook, LeaseWriter
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.headers import RENDEZVOUS, plugin_publish
from celery_ojs_ml.wire.records import republish_headers, request_record
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.finished import settle_claimed
from celery_ojs_ml.worker.gangs import (
    STOPPED,
    GangFailed,
    gang_crash,
    give_up_rank,
    requeue_rank,
    stop_peers,
)
from celery_ojs_ml.worker.preemption import Preemptions
from celery_ojs_ml.worker.running import Running
from celery_ojs_ml.worker.setup import hard_time_limit
from celery_ojs_ml.worker.stopping import ChildStopper
from celery_ojs_ml.worker.telemetry import crashed

log = logging.getLogger("celery_ojs_ml.worker.core")

_STALLED = "this one stalled longer than ojs_ml_lease_ttl_s"
"""Why a copy is fenced when a claimer took its job over."""


class LeaseKeeper:
    """Leases of the jobs this worker runs (see module doc)."""

    def __init__(
        self,
        app: Celery,
        settings: OJSMLSettings,
        allocator: Allocator,
        running: Running,
        preemptions: Preemptions,
        stopper: ChildStopper,
        hostname: str,
        incarnation: str,
    ) -> None:
        self.app, self.settings, self.allocator = app, settings, allocator
        self.running, self.lock, self.tokens = running, running.lock, running.tokens
        self.fenced, self.stopping, self.unacked = running.fenced, running.stopping, running.unacked
        self.preemptions, self.stopper = preemptions, stopper
        self.hostname, self.incarnation = hostname, incarnation
        self.store: OJSStore = None  # type: ignore[assignment]
        self.leases: LeaseBook = None  # type: ignore[assignment]
        self.writer: LeaseWriter = None  # type: ignore[assignment]
        self._collecting = threading.local()
        """`acks`: where `_lease_written` puts the acks of a `release_lease` call."""

    def open(self, store: OJSStore, deferrer: Any, hub: Any) -> None:
        """At every consumer start: the lease book and a writer on this event loop."""
        self.store = store
        self.leases = LeaseBook(store, self.settings.lease_ttl_s)
        self.writer = LeaseWriter(
            self.leases, deferrer, hub, busy_delay_s=self.settings.lease_write_delay_ms / 1000
        )

    def close(self) -> None:
        """Write what is queued, then close the writer (consumer stop)."""
        if self.writer is not None:
            with self.lock:
                self.writer.flush(wait=True)
                self.writer.close()

    def _job_record(self, req: Any, alloc: Allocation, started_at: float) -> dict[str, Any]:
        headers = req.request_dict
        return {
            **request_record(req),
            "worker": self.hostname,
            "incarnation": self.incarnation,
            "devices": list(alloc.devices),
            "started_at": started_at,
            "time_limit_s": hard_time_limit(headers.get("timelimit"), req.task, self.app.conf),
            **({"gpu_milli": alloc.gpu_milli} if alloc.gpu_milli else {}),
        }

    def take_lease(self, req: Any, alloc: Allocation) -> None:
        """Write the job's lease, then ack its message: from now on the lease holds the job.

        The write may be batched (`LeaseWriter`), so Celery's own ack (at accept)
        is suppressed here and `_lease_written` acks once the lease exists. If
        the lease cannot be written (store down, arguments not JSON), the
        message stays unacked until the job ends, so the broker still holds
        the job. The record is built only when the batch goes out: a job that
        ends before then needs no lease.
        """
        started_at = self.store._clock()
        req.acknowledged = True  # Celery must not ack before the lease is written
        token = self.tokens[req] = self.writer.take(
            req.id,
            lambda: self._job_record(req, alloc, started_at),
            lambda ok: self._lease_written(req, ok),
        )
        req.request_dict[h.LEASE] = token  # the child's checkpoint commits check it

    def forget_granted(self, task_id: str) -> None:
        """A job sent under a grant is in this worker's hands (kombu holds it unacked):
        its publisher's record is no longer needed (`store.granted_jobs`)."""
        self.writer.forget(granted_jobs.key(self.store, self.hostname), task_id)

    def _lease_written(self, req: Any, ok: bool) -> None:
        """The lease of `req` exists (or it ended first): ack (or leave the ack to the
        `release_lease` caller that collects it); else the message holds it."""
        if ok:
            acks: list[Any] | None = getattr(self._collecting, "acks", None)
            if acks is not None:
                acks.append(req)
                return
            self.ack(req)
            return
        log.warning("ojs-ml: no lease for %s; its broker message holds it until it ends", req.id)
        self.unacked[req] = True

    def ack(self, req: Any) -> None:
        """Ack a gate-managed request's message once, past the suppression above."""
        if getattr(req, "_ojs_acked", False):
            return
        req._ojs_acked = True
        req.acknowledged = False
        req.acknowledge()

    def tend_leases(self) -> None:
        """Heartbeat our leases; claim and re-publish jobs whose worker died."""
        try:
            with self.lock:
                self.writer.flush(wait=True)  # queued takes first, or they would look lost
                mine, older = self._held_leases()
            if older:  # a newer copy of the same job started here: it was re-published
                self._fence_requests(older, "a newer copy of it started on this worker")
            taken, missing = self.leases.refresh(mine)
            if missing:
                self._lease_missing(set(missing))
            if taken:
                self.fence(set(taken))
            for task_id in self.leases.expired():
                lease = self.leases.claim(task_id, self.hostname, self.incarnation)
                if lease is not None:
                    self.recover(lease, f"its worker {lease.get('worker')} stopped heartbeating")
        except Exception as exc:
            log.warning("ojs-ml: lease upkeep failed: %s", exc)

    def _held_leases(self) -> tuple[dict[str, str], list[Any]]:
        """The lease token of each job running here (the newest copy's, under `lock`), and
        the older copies of a job that started here again: a job is re-published only once
        taken from its copy (a claim, a preemption, a failed gang), so they are stale."""
        mine: dict[str, str] = {}
        newest: dict[str, Any] = {}
        older: list[Any] = []
        for req, token in self.tokens.items():
            if req in self.unacked:
                continue
            if req.id in newest:
                older.append(newest[req.id])
            newest[req.id], mine[req.id] = req, token
        return mine, older

    def fence(self, task_ids: set[str]) -> None:
        """Stop our copies of jobs whose lease another worker took over (invariant 5).

        A claimer only takes a lease that expired, so this worker stalled for
        longer than `ojs_ml_lease_ttl_s` (a frozen process, a partition from
        the store) and the job was re-published elsewhere. Our copy's child is
        killed at once; the failure path then ends it quietly (no result, no
        event, no re-publish, see `_failing`) and frees its devices. The copy
        that took over is the one that counts.
        """
        with self.lock:
            found = [req for req in self.tokens if req.id in task_ids]
        self._fence_requests(found, _STALLED)

    def _fence_requests(self, reqs: list[Any], why: str) -> None:
        """Stop these copies (`fence`): their job runs, or is to run, elsewhere."""
        with self.lock:
            for req in reqs:
                if req in self.fenced:
                    continue
                self.fenced.add(req)
                self.tokens.pop(req, None)  # no longer ours to refresh or release
                pid = getattr(req, "worker_pid", None)
                log.warning(
                    "ojs-ml: the lease of %s[%s] was taken over by another worker (%s); "
                    "stopping this copy (pid %s)",
                    req.name,
                    req.id,
                    why,
                    pid,
                )
                self.stopper.stop_child(req)

    def _lease_missing(self, task_ids: set[str]) -> None:
        """Our lease is gone (store restarted empty, or the job finished elsewhere)."""
        with self.lock:
            found = [(req, tok) for req, tok in self.tokens.items() if req.id in task_ids]
        for req, token in found:
            if self._already_finished(req.id):
                self._fence_requests([req], "it has finished there")
                continue
            if self.leases.was_taken_back(req.id, token):  # re-published while we stalled
                self._fence_requests([req], _STALLED)
                continue
            alloc = next((a for a in self.allocator.allocations() if a.key is req), None)
            if alloc is None:
                continue
            record = self._job_record(req, alloc, self.store._clock())
            try:
                self.leases.take(record, token)
                log.warning(
                    "ojs-ml: the lease of %s had vanished from the store; rewritten", req.id
                )
                self._started_again(req)
            except Exception as exc:
                log.warning("ojs-ml: could not rewrite the lease of %s: %s", req.id, exc)

    def _started_again(self, req: Any) -> None:
        """Record the start of an assigned job again where the store lost it with the lease
        (a failover that lost the last writes): else the leader takes the assignment back
        after `ojs_ml_assignment_timeout_s` and the job would run twice."""
        token = req.request_dict.get(h.ASSIGN)
        if not isinstance(token, str) or not token:
            return  # not delivered by the leader (a grant, or an earlier version's queue)
        if PendingBook(self.store).start(req.id, token, self.hostname) == "ok":
            log.warning("ojs-ml: the start of %s had vanished from the store too", req.id)

    def recover_own(self) -> None:
        """On start, take back the jobs a previous incarnation of this worker was running."""
        try:
            for task_id in self.leases.stale_of(self.hostname, self.incarnation):
                lease = self.leases.claim(
                    task_id, self.hostname, self.incarnation, stale_owner=self.hostname
                )
                if lease is not None:
                    self.recover(lease, "this worker restarted")
        except Exception as exc:
            log.warning("ojs-ml: could not recover this worker's leases: %s", exc)

    def recover(self, lease: dict[str, Any], why: str) -> None:
        """Re-publish a claimed job with the same id and its last checkpoint (or dead-letter)."""
        task_id, token = lease["task_id"], lease["claim_token"]
        if self._already_finished(task_id) or settle_claimed(self.app, self.store, task_id):
            self.leases.release(task_id, token)
            return
        counted = gang_crash(self.store, lease["headers"])  # a gang's crash counts once
        if counted is None:
            crashes = int(lease["headers"].get(h.CRASHES) or 0) + 1
        else:
            crashes, first = counted
            if first:  # its peers may be blocked in the rendezvous or a collective
                stop_peers(self.app, self.store, lease["headers"], task_id)
        # Once the lease is released, a copy still running on a stalled worker must not
        # take it for lost with the store and write it again: it would run on.
        self.leases.mark_taken_back(task_id, lease.get("token"))
        clear_preemption(self.store, task_id)  # asked of the dead copy, not of the next one
        crashed(self.preemptions.c, lease, crashes, crashes > self.settings.max_crashes)
        if crashes > self.settings.max_crashes:
            dead_letter(self.store, lease, f"{why}; crashed {crashes} times")
            self.leases.release(task_id, token)
            return
        headers = republish_headers(
            lease["headers"],
            ojs_crashes=crashes,
            ojs_last_checkpoint=last_checkpoint_of(self.store, task_id),
        )
        log.warning(
            "ojs-ml: re-publishing %s[%s]: %s (crash %d)", lease["name"], task_id, why, crashes
        )
        with plugin_publish():  # the plugin's own headers are kept
            self.app.send_task(
                lease["name"],
                args=lease["args"],
                kwargs=lease["kwargs"],
                task_id=task_id,
                retries=lease["retries"],
                headers=headers,
            )
        self.leases.release(task_id, token)

    def _already_finished(self, task_id: str) -> bool:
        backend = self.app.backend
        if type(backend).__name__ == "DisabledBackend":
            return False
        try:
            return bool(self.app.AsyncResult(task_id).state in ("SUCCESS", "FAILURE", "REVOKED"))
        except Exception:
            return False

    def failing(self, req: Any, original: Any) -> Any:
        """Failure path: re-publish a preempted job; dead-letter a checkpointed one (§14.2)."""

        def wrapped(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            if req in self.fenced:  # killed by `fence`: the copy that took over counts
                self.fenced.discard(req)
                worker_state.task_ready(req)
                log.warning("ojs-ml: stopped this copy of %s; it runs elsewhere", req.id)
                return None
            exc = getattr(exc_info, "exception", None)
            exc = getattr(exc, "exc", exc)
            if isinstance(exc, BaseException) and self._replaced(req, exc):
                return None
            terminal = not isinstance(exc, Retry | Ignore | Reject | Terminated)
            if terminal and RENDEZVOUS in req.request_dict:
                give_up_rank(self.app, req, exc)
            result = original(exc_info, *args, **kwargs)
            verdict = isinstance(exc, ThresholdsNotMet)  # a result, not a crash: kept as is
            if terminal and not verdict and req.request_dict.get("ext_ml_checkpoint_enabled"):
                self._dead_letter_failed(req, exc)
            return result

        return wrapped

    def _replaced(self, req: Any, exc: BaseException) -> bool:
        """A stopped gang rank, a preempted job or a failed gang rank: re-published (or
        given up) here, instead of Celery's own failure handling."""
        if req in self.stopping:  # `ojs_ml_stop_rank`
            self.stopping.discard(req)
            if not self._requeue_rank(req, exc):  # else its gang is placed again
                give_up_rank(self.app, req, GangFailed(STOPPED), event=True)  # not REVOKED
                worker_state.task_ready(req)
            return True
        if self.preemptions.yielded(req, exc):
            self.preemptions.requeue(req, exc)
            return True
        terminal = not isinstance(exc, Retry | Ignore | Reject | Terminated | ThresholdsNotMet)
        return terminal and self._requeue_rank(req, exc)  # its whole gang is placed again

    def _requeue_rank(self, req: Any, exc: BaseException) -> bool:
        return requeue_rank(self.app, self.store, self.settings.max_crashes, req, exc)

    def _dead_letter_failed(self, req: Any, exc: Any) -> None:
        """A checkpointed job failed for good: keep it (`celery ojs-ml dead --retry`)."""
        try:
            dead_letter(self.store, request_record(req), f"failed: {exc!r}")
        except Exception as err:
            log.warning("ojs-ml: could not dead-letter %s: %s", req.id, err)

    def release_lease(self, task_id: str, token: str, acks: list[Any] | None = None) -> None:
        """A job ended: its lease goes with the writer's next batch. Its message, when
        not acked yet (the job ended before its lease was due), is acked now, or with
        `acks` put there for the caller to `ack` (the gate does once it has started the
        next job: an ack is a broker round trip)."""
        self._collecting.acks = acks
        try:
            self.writer.release(task_id, token)
        finally:
            self._collecting.acks = None
