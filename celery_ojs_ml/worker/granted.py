"""The gate's side of a grant: run the class's jobs while the grant is this worker's.

`scheduler.grants` says what a grant is. The worker knows its grants (`mine`: field ->
epoch) from the store, read at every heartbeat and when a job arrives under an epoch it
does not know.

Key decision: a grant's end delays a granted job, never loses or strands it. A job
whose epoch is not this worker's, or that waits too long at a blocked holder, is given
back to the intake with its message, task id and headers unchanged, and the leader
admits and places it as any other. While a grant holds, the consumer reads about as far
ahead as plain Celery's (`sync_prefetch`), and a granted job's end does not wake the
leader (`quiet_release`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery

from celery_ojs_ml import celery_internals as internals
from celery_ojs_ml.allocator import Allocator, Pending
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.store.grants import GrantBook, grants_usable
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.headers import GRANT as HEADER_GRANT
from celery_ojs_ml.wire.headers import GRANT_AT as HEADER_GRANT_AT
from celery_ojs_ml.wire.queues import intake_name, ml_queue
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.assigned import drop, message_of, token_of
from celery_ojs_ml.worker.running import Running

log = logging.getLogger("celery_ojs_ml.worker.core")

_REREAD_S = 0.1
"""Least time between two reads of this worker's grants prompted by an assignment."""
_ENDED_MAX = 4096
"""Ended grant epochs remembered (a job of one is given back without a read)."""


def epoch_of(req: Any) -> str | None:
    """The grant epoch a job was published under; None for an assignment or an admitted job."""
    if token_of(req) is not None:
        return None
    epoch = req.request_dict.get(HEADER_GRANT)
    return epoch if isinstance(epoch, str) and epoch else None


class Grants:
    """`mine`, `grant_current`, `give_back_granted`, `quiet_release`: this worker's grants.

    * Grants are read at every heartbeat, when an assignment arrives (at most every
      `_REREAD_S`: assignments flow again once a grant ends), and when a job arrives
      under an epoch this worker does not know (`grant_current`).
    * A granted job that does not fit yet waits at the gate inside Celery's own
      prefetch limit (plain Celery's behaviour: the prefork pool takes what it
      prefetched as processes free up), not beside it as an assignment held ahead
      does. The first such hold wakes the leader (`hold_granted`), which may end the
      grant where another worker has room. One held `ojs_ml_grant_wait_s` while no
      granted job started here for as long (the holder is blocked, not draining) is
      given back to the intake, and so is one of a grant that ended (grants are read
      again every tick while any is held, and before the pump starts one).
    * While it holds a grant, the consumer keeps only what leaves one job ready beyond
      those its pool can run (`granted_raise`: one with `-c` as many processes as GPUs
      and a prefetch multiplier of 1, none with Celery's default multiplier of 4): the
      `ojs_ml_prefetch` raise makes room for the jobs the leader delivers ahead, and a
      holder's next jobs come from the publishers instead. Jobs read past that would
      only wait at the gate, each costing a hold and a pump that plain Celery's pool
      buffer does not (`bench/dispatch_cpu.py --grants`). The whole raise comes back
      when the holder's last grant ends.
    * A granted job's end does not wake the leader while the grant holds and nothing
      else waits at this gate: nothing waits in the fleet either (a grant lives only
      while nothing does), and the next job of the class is already on its way here.
      That wake-up and its advertisement are most of what a finished job costs the
      fleet's CPU (`bench/dispatch_cpu.py`); the heartbeat still advertises.
    """

    def __init__(
        self,
        app: Celery,
        consumer: Any,
        settings: OJSMLSettings,
        hostname: str,
        allocator: Allocator,
        running: Running,
        caps: Capabilities,
    ) -> None:
        self.app, self.c, self.settings, self.hostname = app, consumer, settings, hostname
        self.allocator, self.lock, self.hold_until = allocator, running.lock, running.hold_until
        self.caps = caps
        self.store: OJSStore = None  # type: ignore[assignment]
        self.mine: dict[str, str] = {}
        self.granted_held: set[Any] = set()
        self.granted_started: float | None = None
        self.on = False
        """Whether grants are used here (`grants_usable`)."""
        self.prefetch_raise: int | None = None
        """The raise the consumer's QoS carries now (`sync_prefetch`); None until the
        worker has opened the consumer's QoS (`open_prefetch`)."""
        self._read_at = 0.0
        self._hold_woke = -1e9
        self._ended: set[str] = set()

    def open(self, store: OJSStore) -> None:
        """At every consumer start: whether grants are used here, and this worker's."""
        self.store = store
        self.mine, self.granted_held, self._read_at = {}, set(), 0.0
        self.granted_started = None
        self._hold_woke = -1e9
        self._ended = set()
        self.on = grants_usable(self.app)
        self.prefetch_raise = None
        self.read_grants()

    def open_prefetch(self, consumer: Any) -> None:
        """Room in the consumer's QoS for the jobs the leader prefetches (`ojs_ml_prefetch`).

        A running ML job keeps its message unacked until its lease is written (a short
        job, until it ends), so with every prefetch slot taken by running jobs a
        prefetched message would only be read once a job ended, too late to start
        without a gap. `c.qos` is new after every consumer (re)start, hence at start. A
        grant holder keeps only part of the raise, or none (`sync_prefetch`)."""
        self.c, self.prefetch_raise = consumer, 0
        self.sync_prefetch()

    def read_grants(self) -> None:
        """Read this worker's grants (heartbeat; never raises)."""
        if not self.on:
            return
        self._read_at = time.monotonic()
        try:
            self.mine = GrantBook(self.store).mine(self.hostname)
        except Exception as exc:
            log.warning("ojs-ml: could not read this worker's grants: %s", exc)
            return
        self.sync_prefetch()

    def sync_prefetch(self) -> None:
        """The raise of the consumer's QoS: `ojs_ml_prefetch` while this worker holds no
        grant; while it holds one, only what keeps one job ready beyond those its pool
        can run (`granted_raise`; class doc). `c.qos` applies it at its next update."""
        if self.prefetch_raise is None:
            return
        want = self.granted_raise() if self.mine else int(self.settings.prefetch)
        qos = getattr(self.c, "qos", None)
        have = self.prefetch_raise
        if want == have or qos is None:
            return
        if want > have:
            qos.increment_eventually(want - have)
        else:
            qos.decrement_eventually(have - want)
        self.prefetch_raise = want

    def granted_raise(self) -> int:
        """A grant holder's raise: Celery's own window (processes x prefetch multiplier,
        celery 5.7 `Consumer._update_prefetch_count`) holds the jobs its processes (at
        most one per GPU) run plus one ready; it is raised only where it does not, and at
        most by `ojs_ml_prefetch`. Unknown pool or multiplier: the whole raise."""
        processes = getattr(getattr(self.c, "pool", None), "num_processes", None)
        multiplier = internals.prefetch_multiplier(self.c)
        prefetch = int(self.settings.prefetch)
        if not isinstance(processes, int) or not isinstance(multiplier, int):
            return prefetch
        gpus = self.caps.gpu_count
        running = min(processes, gpus) if gpus else processes
        return max(0, min(prefetch, running + 1 - processes * multiplier))

    def grant_current(self, epoch: str) -> bool:
        """Whether `epoch` is one of this worker's grants. An unknown one is read again
        (the grant may be newer than the last read); one still unknown after a read made
        since the job arrived has ended for good (epochs are never reused)."""
        if epoch in self.mine.values():
            return True
        if epoch in self._ended:
            return False
        self.read_grants()
        if epoch in self.mine.values():
            return True
        if len(self._ended) >= _ENDED_MAX:
            self._ended.clear()
        self._ended.add(epoch)
        return False

    def recheck_grants(self) -> None:
        """Read this worker's grants again unless that was done within `_REREAD_S`; give
        back the held jobs of a grant that ended."""
        if time.monotonic() - self._read_at >= _REREAD_S:
            self.read_grants()
            self.return_revoked()

    def give_back_granted(self, req: Any, why: str) -> None:
        """Send a granted job to the intake (the leader admits it), then drop this copy."""
        msg = message_of(req)  # without the grant's epoch (a scheduler header)
        sent = req.request_dict.get(HEADER_GRANT_AT)
        if sent is not None:  # admitted in its place in first-come order
            msg["headers"][HEADER_GRANT_AT] = sent
        name = intake_name(self.settings.store_prefix)
        try:
            with self.app.producer_or_acquire() as producer:
                producer.publish(
                    req.body,
                    exchange=name,
                    routing_key=name,
                    headers=msg["headers"],
                    declare=[ml_queue(name)],
                    content_type=req.content_type,
                    content_encoding=req.content_encoding,
                    serializer=None,
                    retry=True,
                    **msg["properties"],
                )
        except Exception as exc:  # keep the message: the broker redelivers it here
            log.warning("ojs-ml: could not give %s back to the intake: %s", req.id, exc)
            return
        log.info("ojs-ml: gave %s back to the intake: %s", req.id, why)
        drop(req)

    def quiet_release(self, req: Any) -> bool:
        """Whether a job's end may skip the leader's wake-up (see the class doc)."""
        epoch = epoch_of(req)
        if epoch is None or epoch not in self.mine.values():
            return False
        return self.granted_held.issuperset(self.allocator.held_keys())

    def hold_granted(self, req: Any, outcome: Pending) -> bool:
        """Hold a granted job that does not fit yet, inside Celery's prefetch limit; True
        when it is the only one held here and no such hold woke the leader within
        `ojs_ml_scheduler_interval_s` (the caller then wakes it: a holder with a backlog
        may be revoked where another worker has room; a burst whose holds come and go
        job by job wakes it at most that often, not once per job)."""
        self.allocator.hold(outcome)
        first = not self.granted_held
        self.granted_held.add(req)
        now = time.monotonic()
        if not first or now - self._hold_woke < self.settings.scheduler_interval_s:
            return False
        self._hold_woke = now
        return True

    def granted_started_at(self) -> float | None:
        """When a job sent under a grant last started here (seconds since the epoch), for
        the heartbeat: the leader takes a holder's queue back once the holder has
        started none for `ojs_ml_grant_wait_s` while the oldest queued job waited that
        long. None: none started yet."""
        if self.granted_started is None:
            return None
        return time.time() - (time.monotonic() - self.granted_started)

    def expire_granted(self) -> None:
        """Give back the granted jobs held here longer than `ojs_ml_grant_wait_s` while no
        granted job started here for as long (the holder is blocked, not draining a
        burst: the scheduler orders, annotates and places a job that waits on a blocked
        holder), and those of a grant that ended (read again while any is held)."""
        if not self.granted_held:
            return
        self.recheck_grants()
        limit = self.settings.grant_wait_s
        started = self.granted_started
        if started is not None and time.monotonic() - started <= limit:
            return
        with self.lock:
            old = [
                p.key
                for p in self.allocator.held()
                if p.key in self.granted_held and self.allocator.waited(p) > limit
            ]
        self._give_back_held(old, f"held {limit:g} s here, none started meanwhile")

    def return_revoked(self) -> None:
        """Give back the granted jobs held here whose grant ended (after `read_grants`)."""
        current = set(self.mine.values())
        with self.lock:
            gone = [r for r in self.granted_held if epoch_of(r) not in current]
        self._give_back_held(gone, "its class's grant ended")

    def _give_back_held(self, reqs: list[Any], why: str) -> None:
        """Stop holding these granted jobs and give them back to the intake."""
        with self.lock:
            for req in reqs:
                self.allocator.cancel(req)
                self.granted_held.discard(req)
                self.hold_until.pop(req, None)
        for req in reqs:
            self.give_back_granted(req, why)
