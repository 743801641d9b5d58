"""The durable pending set and its assignments (DESIGN decision 9): one record per job.

A job with hard constraints is admitted here (its Celery message kept as it was
published), waits with RFC 27 annotations, is assigned to one worker with a fresh
token, and is started by that worker's gate only if the token is still current.

Key decision: states `pending` -> `assigned` (worker, token) -> `started` (a tombstone
kept for a day, so a late duplicate delivery is recognised), or back to `pending`
(returned by the gate, or taken back after `ojs_ml_assignment_timeout_s`). A gate whose
token is no longer current drops its copy: a lost or stuck delivery neither loses the
job nor runs it twice. The record layout is in `pending_records`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import redis

from celery_ojs_ml.lru import LRU
from celery_ojs_ml.store import pending_scripts as scripts
from celery_ojs_ml.store.leader_lock import LeaderLock
from celery_ojs_ml.store.pending_admit import PendingAdmission
from celery_ojs_ml.store.pending_assign import PendingAssigner
from celery_ojs_ml.store.pending_read import PendingReader
from celery_ojs_ml.store.pending_records import (
    _NO_SCRIPTING,
    ASSIGNED,
    CANCELLED,
    HEADER_MSG,
    PENDING,
    STARTED,
    TOMBSTONE_S,
    _decode,
    _text,
    compare_and_set,
    job_key,
    transaction,
)
from celery_ojs_ml.store.registry import OJSStore

__all__ = [
    "ASSIGNED",
    "CANCELLED",
    "HEADER_MSG",
    "PENDING",
    "STARTED",
    "TOMBSTONE_S",
    "PendingBook",
]

_MSG_CACHE = 20_000
"""Decoded messages the leader keeps between passes (`records`)."""
log = logging.getLogger(__name__)

Notes = Mapping[str, tuple[str, float | None, str | None]]
"""RFC 27 annotations: `{task_id: (reason_pending, t_estimate, worker)}`."""
Assignment = tuple[str, str, str, tuple[str, bytes] | None]
"""(task id, worker, token, push) of `assign_many`."""


class PendingBook:
    """Pending jobs, assignments and the scheduler lock of one store.

    The facade every side uses; admission (`pending_admit`), reads (`pending_read`),
    the leader's assignments (`pending_assign`) and the lock (`leader_lock`) are
    collaborators it delegates to. The gate's and the API's state changes are here.
    """

    def __init__(self, store: OJSStore) -> None:
        self.store = store
        self._r = store.client
        self._index = store.key("pjobs")
        self._changed = store.key("pdirty")
        self.on_admit: Callable[[str, dict[str, Any]], None] = lambda task_id, record: None
        """Told of each record `admit_many` wrote (the leader's `PendingView.put`): the
        only admissions not marked in `pdirty`, as only the leader admits."""
        self._start_script: Any = self._r.register_script(scripts.START)
        msgs: LRU[tuple[str, str], dict[str, Any]] = LRU(_MSG_CACHE)
        self.reader = PendingReader(store, msgs)
        self.admission = PendingAdmission(store, msgs, lambda t, r: self.on_admit(t, r))
        self.assigner = PendingAssigner(store)
        self.lock = LeaderLock(store)

    def _key(self, task_id: str) -> str:
        return job_key(self.store, task_id)

    @property
    def index_key(self) -> str:
        """The sorted set of waiting and assigned jobs, scored by admission."""
        return self._index

    @property
    def changed_key(self) -> str:
        """The set of jobs whose record changed since the leader last took it."""
        return self._changed

    # -- reads (`pending_read`) ---------------------------------------------------------------

    def get(self, task_id: str) -> dict[str, Any] | None:
        """The record of one job (any state), or None."""
        return self.reader.get(task_id)

    def records(self, *, lean: bool = False) -> dict[str, dict[str, Any]]:
        """Every waiting or assigned job: `{task_id: record}`, in admission order."""
        return self.reader.records(lean=lean)

    def read(self, ids: list[str], *, lean: bool = True) -> dict[str, dict[str, Any]]:
        """The waiting or assigned records of `ids`; the others leave the index."""
        return self.reader.read(ids, lean=lean)

    def index_and_changes(self) -> tuple[list[str], set[str]]:
        """The index and the ids marked changed since the last call, in one transaction."""
        return self.reader.index_and_changes()

    def started_at(self, task_ids: list[str]) -> dict[str, float | None]:
        """When each job's gate started it; None when it is not started or has no record."""
        return self.reader.started_at(task_ids)

    def read_started(self, pipe: Any, task_ids: list[str]) -> None:
        """`started_at`'s reads, queued on `pipe` (the leader's pass reads carry them)."""
        self.reader.read_started(pipe, task_ids)

    def parse_started(self, task_ids: list[str], rows: list[Any]) -> dict[str, float | None]:
        """`started_at` from the replies of `read_started`."""
        return self.reader.parse_started(task_ids, rows)

    # -- admission (`pending_admit`) -------------------------------------------------------

    def admit(self, task_id: str, meta: dict[str, Any], msg: dict[str, Any]) -> bool:
        """Add a job (its message and metadata); False when it is already known."""
        return self.admission.admit(task_id, meta, msg)

    def admit_many(self, jobs: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[bool]:
        """`admit` for a batch in one transaction (the leader drains its intake in batches)."""
        return self.admission.admit_many(jobs)

    def admit_in(
        self, pipe: Any, jobs: list[tuple[str, dict[str, Any], dict[str, Any]]]
    ) -> Callable[[Any], list[bool]] | None:
        """Queue `admit_many(jobs)` on `pipe`; None where the store runs no Lua."""
        return self.admission.admit_in(pipe, jobs)

    # -- the scheduler lock (`leader_lock`) --------------------------------------------------

    def lead(self, candidate: str, ttl_s: float, *, pass_s: float | None = None) -> bool:
        """Take or renew the scheduler lock; True while `candidate` holds it (`pass_s`:
        the holder's last pass, kept in the record by a renewal)."""
        return self.lock.lead(candidate, ttl_s, pass_s=pass_s)

    def resign(self, candidate: str) -> None:
        """Give the lock up at once (a clean shutdown), if `candidate` holds it."""
        self.lock.resign(candidate)

    def leader(self) -> dict[str, Any] | None:
        """`{id, since}` of the current scheduler, or None."""
        return self.lock.leader()

    # -- the leader's assignments and annotations (`pending_assign`) -------------------------

    def assign(
        self,
        task_id: str,
        worker: str,
        *,
        now: float,
        victims: Iterable[str] = (),
        token: str | None = None,
        push: tuple[str, bytes] | None = None,
    ) -> str | None:
        """`pending` -> `assigned` to `worker` with a fresh token (or `token`); None if not
        pending. `push` (list key, raw message): LPUSHed in the same call."""
        return self.assigner.assign(
            task_id, worker, now=now, victims=victims, token=token, push=push
        )

    def assign_many(
        self,
        items: Sequence[Assignment],
        now: float,
        notes: Notes | None = None,
        also: Callable[[Any], None] | None = None,
        before: Callable[[Any], Callable[[Any], None] | None] | None = None,
    ) -> list[str | None]:
        """`assign` of each item and `annotate(notes)` in one pipeline (`PendingAssigner`)."""
        return self.assigner.assign_many(items, now, notes, also, before)

    def annotate(self, notes: Notes, *, ahead: bool = False) -> None:
        """RFC 27 annotate: `{task_id: (reason_pending, t_estimate, worker)}` in one round trip."""
        self.assigner.annotate(notes, ahead=ahead)

    # -- the gate's start and return, the API's requests ---------------------------------------

    def start(self, task_id: str, token: str, worker: str) -> str:
        """The gate starts the job: "ok", "stale" (another assignment is current), "again"
        or "unknown".

        "again": this very assignment was started before, and the broker delivers
        its message once more (the run died before its lease was written, so the
        message was not acked); the gate runs it unless a lease shows the first
        run alive. "unknown" (no record: the store lost it) lets the gate run the
        job: the message is the only copy left.
        """
        key = self._key(task_id)
        if self._start_script is not None:
            args = [token, repr(self.store._clock()), TOMBSTONE_S, task_id]
            try:
                return _text(self._start_script(keys=[key, self._index], args=args))
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except _NO_SCRIPTING as exc:
                log.info("ojs-ml: no Lua scripting on the store (%s); starts use MULTI/WATCH", exc)
                self._start_script = None
        return self._start_watched(task_id, token)

    def _start_watched(self, task_id: str, token: str) -> str:
        key = self._key(task_id)

        def txn(pipe: Any) -> str:
            raw = pipe.hgetall(key)
            record = _decode(raw) if raw else {}
            if "state" not in record:  # gone, or only a late annotation of a gone record
                return "unknown"
            if record.get("token") != token:
                return "stale"
            if record.get("state") == STARTED:
                return "again"
            if record.get("state") != ASSIGNED:
                return "stale"
            pipe.multi()
            pipe.hset(key, mapping={"state": STARTED, "started_at": repr(self.store._clock())})
            pipe.hdel(key, "msg")
            pipe.expire(key, TOMBSTONE_S)
            pipe.zrem(self._index, task_id)
            return "ok"

        return str(transaction(self._r, key, txn))

    def give_back(
        self,
        task_id: str,
        token: str,
        reason: str,
        *,
        cool: bool = True,
        msg: dict[str, Any] | None = None,
    ) -> bool:
        """`assigned` (with this token) -> `pending` with a reason; the gate could not run it.

        `cool`: stamp `returned_at`, so the scheduler lets the job sit out a moment.
        `msg`: the message of a copy the gate got *again* (see `start`), passed only when
        no lease shows the first run alive (it died before its lease was written): a
        `started` record of this token goes back to `pending` with it, as the only copy.
        """
        key = self._key(task_id)
        fields = {"state": PENDING, "reason": reason}
        if cool:
            fields["returned_at"] = repr(self.store._clock())
        drop = ("token", "worker", "assigned_at", *(() if cool else ("returned_at",)))

        def txn(pipe: Any) -> bool:
            raw = pipe.hgetall(key)
            record = _decode(raw) if raw else {}
            if record.get("token") != token:
                return False
            again = record.get("state") == STARTED and msg is not None
            if record.get("state") != ASSIGNED and not again:
                return False
            pipe.multi()
            pipe.hset(key, mapping={**fields, **({"msg": json.dumps(msg)} if again else {})})
            pipe.hdel(key, *drop, *(("started_at",) if again else ()))
            pipe.sadd(self._changed, task_id)
            if again:
                _wait_again(pipe, key, self._index, task_id, record)
            return True

        return bool(transaction(self._r, key, txn))

    def take_back(self, task_id: str, token: str, reason: str, *, cool: bool = True) -> bool:
        """The scheduler takes back an assignment its worker did not start (fenced by token)."""
        return self.give_back(task_id, token, reason, cool=cool)

    def cancel(self, task_id: str) -> bool:
        """RFC 27 cancel: drop a job no worker has started (waiting or assigned); True if so.

        The record becomes a `cancelled` tombstone for a day, so an assigned copy
        in flight is stale at the gate and a late intake duplicate is not admitted.
        """
        key = self._key(task_id)

        def txn(pipe: Any) -> bool:
            state = pipe.hget(key, "state")
            if state is None or _text(state) in (STARTED, CANCELLED):
                return False
            pipe.multi()
            pipe.hset(key, "state", CANCELLED)
            pipe.hdel(key, "msg")
            pipe.sadd(self._changed, task_id)
            pipe.expire(key, TOMBSTONE_S)
            pipe.zrem(self._index, task_id)
            return True

        return bool(transaction(self._r, key, txn))

    def prioritize(self, task_id: str, priority: int) -> bool:
        """RFC 27 prioritize: a waiting job's priority; True if the job waits."""
        return compare_and_set(
            self.store,
            task_id,
            lambda r: r.get("state") == PENDING,
            {"priority": str(int(priority))},
        )

    def hold(self, task_id: str, until: float) -> None:
        """The gate holds the job while its victims yield, until `until` (epoch seconds)."""
        with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(task_id), "hold_until", json.dumps(until))
            pipe.sadd(self._changed, task_id)
            pipe.execute()


def _wait_again(pipe: Any, key: str, index: str, task_id: str, record: dict[str, Any]) -> None:
    """A started record waits again (`give_back` with `msg`): no tombstone expiry, and
    back in the index at its submission time."""
    pipe.persist(key)
    meta = record.get("meta")
    meta = meta if isinstance(meta, dict) else {}
    pipe.zadd(index, {task_id: float(meta.get("submitted_at") or 0.0)})
