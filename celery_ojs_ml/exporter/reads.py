"""What one scrape reads from the store, in as few round trips as the store allows.

Key decisions:
* One pipeline carries every read a scrape needs: the live workers (the store's
  `indexed` script, read without pruning: the exporter writes nothing), the
  pending set's index, the leader lock, the budgets, the dead-letter count and
  the reservation records.
* A waiting job's band and queue never change while its admission stands, and a
  running job's queue never changes while it runs, so both are kept between
  scrapes: only jobs new since the last scrape are read, in one more pipeline
  (none at all when nothing new arrived). Entries leave with their jobs.
* A store that runs no Lua (fakeredis) gets the workers through `live_workers()`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from celery_ojs_ml.store.pending import ASSIGNED, PENDING, PendingBook
from celery_ojs_ml.store.pending_records import job_key
from celery_ojs_ml.store.registry import OJSStore, _text, pairs
from celery_ojs_ml.store.reservations import ReservationBook
from celery_ojs_ml.wire import headers as h

Job = tuple[str, str]
"""(band, queue) of a job."""


@dataclass
class Snapshot:
    """The store as one scrape saw it."""

    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """`OJSStore.live_workers()`: capabilities, free capacity and allocations."""
    pending: Counter[Job] = field(default_factory=Counter)
    """Waiting (or assigned, not started) jobs per (band, queue)."""
    running: Counter[Job] = field(default_factory=Counter)
    """Jobs in live workers' allocations per (band, queue)."""
    leader: dict[str, Any] | None = None
    """The scheduler lock's record: `{id, since, pass_s}`."""
    budgets: dict[str, Any] = field(default_factory=dict)
    """The leader's last budget report: `{queue: {gpus, max_total_gpus, ...}}`."""
    dead: int = 0
    reservations: Counter[str] = field(default_factory=Counter)
    """Reservation records per state."""


def _json(raw: Any) -> Any:
    try:
        return json.loads(raw) if raw else None
    except (TypeError, ValueError):
        return None


class StoreReader:
    """Reads a `Snapshot` per scrape, keeping what does not change (see module doc)."""

    def __init__(self, store: OJSStore) -> None:
        self.store = store
        self._pjobs = PendingBook(store).index_key
        self._leader = store.key("scheduler", "leader")
        self._budgets = store.key("scheduler", "budgets")
        self._dead = store.key("dead-index")
        self._reservations = ReservationBook(store).key
        self._waiting: dict[str, Job] = {}
        """Band and queue of each job in the pending set's index."""
        self._queues: dict[str, str] = {}
        """Logical queue of each running job, from its lease."""

    def read(self) -> Snapshot:
        """One scrape's view of the store (one round trip, two when jobs arrived)."""
        snap = Snapshot()
        ids = self._first(snap)
        self._jobs(snap, ids)
        return snap

    def _first(self, snap: Snapshot) -> list[str]:
        """Every read but the new jobs' records; returns the pending set's index."""
        sha = self.store.indexed_sha
        index, prefix, _ = self.store.live_read("worker")
        with self.store.client.pipeline(transaction=False) as pipe:
            if sha is not None:
                pipe.evalsha(sha, 1, index, "", prefix)
            pipe.zrange(self._pjobs, 0, -1)
            pipe.get(self._leader)
            pipe.get(self._budgets)
            pipe.zcard(self._dead)
            pipe.hvals(self._reservations)
            replies = pipe.execute(raise_on_error=False)
        workers = replies.pop(0) if sha is not None else None
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        ids, leader, budgets, dead, reservations = replies
        snap.workers = self._workers(workers)
        snap.leader = leader_record(_json(leader))
        found = _json(budgets)
        snap.budgets = found if isinstance(found, dict) else {}
        snap.dead = int(dead or 0)
        states = (r.get("state") for r in map(_json, reservations) if isinstance(r, dict))
        snap.reservations = Counter(s for s in states if isinstance(s, str))
        return [_text(i) for i in ids]

    def _workers(self, reply: Any) -> dict[str, dict[str, Any]]:
        """The indexed script's reply parsed; read again where the server did not hold
        the script (that read loads it) or runs no Lua."""
        if reply is None or isinstance(reply, redis.exceptions.NoScriptError):
            return self.store.live_workers()
        if isinstance(reply, Exception):
            raise reply
        found = {name: _json(value) for name, value in pairs(reply)}
        return {name: record for name, record in found.items() if isinstance(record, dict)}

    def _jobs(self, snap: Snapshot, ids: list[str]) -> None:
        """Pending and running counts; the records of jobs new since the last scrape."""
        running = _allocations(snap.workers)
        self._waiting = {i: self._waiting[i] for i in ids if i in self._waiting}
        self._queues = {i: self._queues[i] for i in running if i in self._queues}
        new_waiting = [i for i in ids if i not in self._waiting]
        new_running = [i for i in running if i not in self._queues]
        if new_waiting or new_running:
            self._read_new(new_waiting, new_running)
        snap.pending = Counter(self._waiting[i] for i in ids if i in self._waiting)
        snap.running = Counter((band, self._queues.get(i, "")) for i, band in running.items())

    def _read_new(self, waiting: list[str], running: list[str]) -> None:
        with self.store.client.pipeline(transaction=False) as pipe:
            for task_id in waiting:
                pipe.hmget(job_key(self.store, task_id), "state", "meta")
            for task_id in running:
                pipe.get(self.store.lease_key(task_id))
            replies = pipe.execute()
        for task_id, (state, meta) in zip(waiting, replies[: len(waiting)], strict=True):
            job = _waiting_job(state, _json(meta))
            if job is not None:  # a job not waiting any more is read again next time
                self._waiting[task_id] = job
        for task_id, raw in zip(running, replies[len(waiting) :], strict=True):
            lease = _json(raw)
            if isinstance(lease, dict):  # no lease yet (its write is batched): next time
                queue = (lease.get("headers") or {}).get(h.LOGICAL)
                self._queues[task_id] = queue if isinstance(queue, str) else ""


def leader_record(value: Any) -> dict[str, Any] | None:
    """The scheduler lock's record, or None."""
    return value if isinstance(value, dict) and value.get("id") else None


def _waiting_job(state: Any, meta: Any) -> Job | None:
    """(band, queue) of a pending-set record that waits or is assigned, else None."""
    if state is None or _text(state) not in (PENDING, ASSIGNED) or not isinstance(meta, dict):
        return None
    band, queue = meta.get("band"), meta.get("queue")
    return (band if isinstance(band, str) else "", queue if isinstance(queue, str) else "")


def _allocations(workers: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Task id -> band of every ML job the live workers advertise as running."""
    found: dict[str, str] = {}
    for record in workers.values():
        for alloc in (record.get("free") or {}).get("allocations") or ():
            task_id, band = alloc.get("task_id"), alloc.get("band")
            if isinstance(task_id, str):
                found[task_id] = band if isinstance(band, str) else ""
    return found
