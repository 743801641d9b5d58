"""The durable pending set and its assignments (DESIGN decision 9): one record per job.

Responsibility: the store side of the fleet scheduler. A job with hard
constraints is admitted here (its Celery message kept as it was published),
waits with RFC 27 annotations, is assigned to one worker with a fresh token,
and is started by that worker's gate only if the token is still current.

Key decisions:
- One hash per job, so every state change is one WATCH/MULTI transaction on
  one key (no Lua: fakeredis in the embedded demo evaluates none).
- States: `pending` -> `assigned` (worker, token, at) -> `started` (a
  tombstone kept for a day, so a late duplicate delivery is recognised) or
  back to `pending` (returned by the gate, or taken back after
  `ojs_ml_assignment_timeout_s`). A gate whose token is no longer current
  drops its copy: a lost or stuck delivery neither loses the job nor runs it
  twice.
- The leader lock is a plain `SET NX PX` renewed by its holder only (as
  celery-redbeat's lock): another candidate takes over when it expires.

Layout (prefix `ojs`):
    ojs:{ml}:pjob:<task id>     hash  state, msg, meta, worker, token, assigned_at, reason, ...
    ojs:{ml}:pjobs              zset  task id -> admitted at (waiting or assigned jobs)
    ojs:{ml}:pdirty             set   task ids another client changed since the leader's
                                      last pass (`PendingView` reads only those again)
    ojs:{ml}:scheduler:leader   string  JSON {id, since}, PX = ojs_ml_leader_ttl_s
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import redis

from celery_ojs_ml.lru import LRU
from celery_ojs_ml.store import pending_scripts as scripts
from celery_ojs_ml.store.leader_lock import LeaderLock
from celery_ojs_ml.store.pending_admit import (
    _NO_SCRIPTING,
    ASSIGNED,
    CANCELLED,
    HEADER_MSG,
    PENDING,
    STARTED,
    Admitting,
    _text,
)
from celery_ojs_ml.store.pending_read import Reading, _decode
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

TOMBSTONE_S = 86400
_MSG_CACHE = 20_000
"""Decoded messages the leader keeps between passes (`records`)."""
_RETRIES = 16
log = logging.getLogger(__name__)


class PendingBook(Admitting, LeaderLock, Reading):
    """Pending jobs, assignments and the scheduler lock of one store."""

    def __init__(self, store: OJSStore) -> None:
        self.store = store
        self._r = store.client
        self._index = store.key("pjobs")
        self._changed = store.key("pdirty")
        self.on_admit: Callable[[str, dict[str, Any]], None] = lambda task_id, record: None
        """Told of each record `admit_many` wrote (the leader's `PendingView.put`): the
        only admissions not marked in `pdirty`, as only the leader admits."""
        self._prune_script: Any = self._r.register_script(scripts.PRUNE)
        self._admit_script: Any = self._r.register_script(scripts.ADMIT)
        self._start_script: Any = self._r.register_script(scripts.START)
        self._assign_script: Any = self._r.register_script(scripts.ASSIGN)
        self._leader = store.key("scheduler", "leader")
        self._msgs: LRU[tuple[str, str], dict[str, Any]] = LRU(_MSG_CACHE)

    def _key(self, task_id: str) -> str:
        return self.store.key("pjob", task_id)

    @property
    def index_key(self) -> str:
        """The sorted set of waiting and assigned jobs, scored by admission."""
        return self._index

    @property
    def changed_key(self) -> str:
        """The set of jobs whose record changed since the leader last took it."""
        return self._changed

    # -- assignment, start and return ----------------------------------------------------

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
        pending. `push` (list key, raw message): LPUSHed in the same call when it assigns
        (the leader's delivery, `redis_intake.envelope`)."""
        token = token or uuid.uuid4().hex
        fields = {
            "state": ASSIGNED,
            "worker": worker,
            "token": token,
            "assigned_at": repr(now),
            "victims": json.dumps(list(victims)),
        }
        if self._assign_script is not None:
            keys, args = self._assign_call(task_id, worker, token, fields, push)
            try:
                return token if self._assign_script(keys=keys, args=args) else None
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except _NO_SCRIPTING as exc:
                log.info("ojs-ml: no Lua scripting on the store (%s); assigns use MULTI/WATCH", exc)
                self._assign_script = None
        ok = self._cas(task_id, lambda r: r.get("state") == PENDING, fields)
        if ok and push is not None:
            self._r.lpush(*push)
        return token if ok else None

    def assign_many(
        self,
        items: Sequence[tuple[str, str, str, tuple[str, bytes] | None]],
        now: float,
        notes: Mapping[str, tuple[str, float | None, str | None]] | None = None,
        also: Callable[[Any], None] | None = None,
        before: Callable[[Any], Callable[[Any], None] | None] | None = None,
    ) -> list[str | None]:
        """`assign` of (task id, worker, token, push) each, and `annotate(notes)`, in one
        pipeline where the store runs Lua; each item's token, or None where the job was
        not pending any more. `also` may queue more commands on that pipeline (it is
        not called where there is none); `before` queues commands ahead of them and returns
        what takes their reply (as in `pass_reads`; without Lua it raises, nothing assigned).

        The script goes out as a bare `EVALSHA`: redis-py's pipelined `Script` asks
        `SCRIPT EXISTS` first, a round trip of its own on every pass. Where the server
        does not hold the script (its first use, a restart) those items are assigned
        again one by one, which loads it."""
        script = self._assign_script
        replies = (
            None if script is None else self._assign_pipelined(items, now, notes, also, before)
        )
        if replies is None and before is not None:
            raise RuntimeError("assign_many(before=...) needs Lua on the store")
        if replies is None:  # no Lua (or it failed): one by one, `assign` finds out for good
            self.annotate(notes or {})
            return [self.assign(t, w, now=now, token=k, push=p) for t, w, k, p in items]
        tokens: list[str | None] = []
        for (task_id, worker, token, push), ok in zip(items, replies, strict=False):
            if isinstance(ok, _NO_SCRIPTING):  # the server does not hold the script: it loads it
                ok = self.assign(task_id, worker, now=now, token=token, push=push)
            elif isinstance(ok, Exception):
                raise ok
            tokens.append(token if ok else None)
        for reply in replies[len(items) :]:
            if isinstance(reply, Exception):
                raise reply
        return tokens

    def _assign_pipelined(
        self,
        items: Sequence[tuple[str, str, str, tuple[str, bytes] | None]],
        now: float,
        notes: Mapping[str, tuple[str, float | None, str | None]] | None,
        also: Callable[[Any], None] | None,
        before: Callable[[Any], Callable[[Any], None] | None] | None = None,
    ) -> list[Any] | None:
        """`assign_many`'s pipeline: each item's reply (or error), then the notes'; None
        where the store runs no Lua."""
        fields = {"assigned_at": repr(now), "victims": "[]"}
        sha = self._assign_script.sha
        try:
            with self._r.pipeline(transaction=False) as pipe:
                first = before(pipe) if before is not None else None
                for task_id, worker, token, push in items:
                    keys, args = self._assign_call(task_id, worker, token, fields, push)
                    pipe.evalsha(sha, len(keys), *keys, *args)
                self._annotations(pipe, notes or {})
                if also is not None:
                    also(pipe)
                replies = list(pipe.execute(raise_on_error=False))
                if first is not None:
                    first(replies.pop(0))
                return replies
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except _NO_SCRIPTING as exc:
            log.info("ojs-ml: pipelined assignments failed (%s); one at a time", exc)
            return None

    def _assign_call(
        self,
        task_id: str,
        worker: str,
        token: str,
        fields: Mapping[str, str],
        push: tuple[str, bytes] | None,
    ) -> tuple[list[str], list[str]]:
        """The ASSIGN script's keys and arguments."""
        args = [worker, token, fields["assigned_at"], fields["victims"], task_id]
        keys = [self._key(task_id), self._changed]
        if push is not None:
            keys, args = [*keys, push[0]], [*args, push[1].decode()]
        return keys, args

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

        return str(self._transaction(key, txn))

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
        `msg`: the message of a copy the gate got *again* (see `start`): a `started`
        record of this token goes back to `pending` with it. The gate passes it only
        when no lease shows the first run alive: the run died before its lease was
        written, its message was restored by the broker, and that copy is the only
        one left, so dropping it would lose the job.
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
            if again:  # a waiting job again: no tombstone expiry, back in the index
                pipe.persist(key)
                meta = record.get("meta")
                meta = meta if isinstance(meta, dict) else {}
                pipe.zadd(self._index, {task_id: float(meta.get("submitted_at") or 0.0)})
            return True

        return bool(self._transaction(key, txn))

    def take_back(self, task_id: str, token: str, reason: str, *, cool: bool = True) -> bool:
        """The scheduler takes back an assignment its worker did not start (fenced by token)."""
        return self.give_back(task_id, token, reason, cool=cool)

    def annotate(
        self, notes: Mapping[str, tuple[str, float | None, str | None]], *, ahead: bool = False
    ) -> None:
        """RFC 27 annotate: `{task_id: (reason_pending, t_estimate, worker)}` in one round trip.
        `ahead`: the jobs were delivered ahead of capacity and wait at `worker`'s gate."""
        if not notes:
            return
        with self._r.pipeline(transaction=False) as pipe:
            self._annotations(pipe, notes, ahead)
            pipe.execute()

    def _annotations(
        self,
        pipe: Any,
        notes: Mapping[str, tuple[str, float | None, str | None]],
        ahead: bool = False,
    ) -> None:
        for task_id, (reason, t_est, worker) in notes.items():
            note: dict[str, Any] = {"reason_pending": reason, "t_estimate": t_est, "worker": worker}
            if ahead:
                note["ahead"] = True
            pipe.hset(self._key(task_id), "annotation", json.dumps(note))

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

        return bool(self._transaction(key, txn))

    def prioritize(self, task_id: str, priority: int) -> bool:
        """RFC 27 prioritize: a waiting job's priority; True if the job waits."""
        return self._cas(
            task_id, lambda r: r.get("state") == PENDING, {"priority": str(int(priority))}
        )

    def hold(self, task_id: str, until: float) -> None:
        """The gate holds the job while its victims yield, until `until` (epoch seconds)."""
        with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(task_id), "hold_until", json.dumps(until))
            pipe.sadd(self._changed, task_id)
            pipe.execute()

    # -- transactions ------------------------------------------------------------------------

    def _cas(
        self,
        task_id: str,
        test: Any,
        fields: dict[str, str],
        drop: tuple[str, ...] = (),
    ) -> bool:
        key = self._key(task_id)

        def txn(pipe: Any) -> bool:
            raw = pipe.hgetall(key)
            if not raw or not test(_decode(raw)):
                return False
            pipe.multi()
            pipe.hset(key, mapping=fields)
            if drop:
                pipe.hdel(key, *drop)
            pipe.sadd(self._changed, task_id)
            return True

        return bool(self._transaction(key, txn))

    def _transaction(self, key: str | list[str], body: Any) -> Any:
        """Run `body(pipe)` under WATCH `key`(s); retried when another client changed one."""
        keys = [key] if isinstance(key, str) else key
        for _ in range(_RETRIES):
            with self._r.pipeline(transaction=True) as pipeline:
                pipe: Any = pipeline
                try:
                    pipe.watch(*keys)
                    result = body(pipe)
                    if pipe.explicit_transaction:
                        pipe.execute()
                    return result
                except redis.WatchError:
                    continue
        raise redis.RedisError(f"{keys[0]} kept changing under {_RETRIES} transactions; retry")
