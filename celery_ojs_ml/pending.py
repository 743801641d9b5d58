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
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis

from celery_ojs_ml import pending_scripts as scripts
from celery_ojs_ml.lru import LRU
from celery_ojs_ml.pending_admit import (
    _NO_SCRIPTING,
    ASSIGNED,
    CANCELLED,
    HEADER_MSG,
    PENDING,
    STARTED,
    Admitting,
    _text,
)
from celery_ojs_ml.pending_lock import LeaderLock
from celery_ojs_ml.store import OJSStore

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
_LEAN = ("state", "meta", "admitted_at", "worker", "token", "assigned_at", "hold_until",
         "returned_at", "priority", "reason", "victims")  # fmt: skip
"""The fields of a record the leader reads on every pass (`records(lean=True)`)."""
_CACHED = b"\x00cached"
"""Stands for a message `_lean` did not read because the cache holds it."""
_RETRIES = 16
_JSON_FIELDS = ("msg", "meta", "annotation", "victims", "seen")
log = logging.getLogger(__name__)


def _decode(raw: Mapping[Any, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {}
    for key, value in raw.items():
        name = _text(key)
        text = _text(value)
        record[name] = json.loads(text) if name in _JSON_FIELDS else text
    return record


class PendingBook(Admitting, LeaderLock):
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

    def get(self, task_id: str) -> dict[str, Any] | None:
        """The record of one job (any state), or None."""
        raw = self._r.hgetall(self._key(task_id))
        return _decode(raw) if raw else None

    def started_at(self, task_ids: list[str]) -> dict[str, float | None]:
        """When each job's gate started it; None when it is not started or has no record."""
        with self._r.pipeline(transaction=False) as pipe:
            for task_id in task_ids:
                pipe.hmget(self._key(task_id), "state", "started_at")
            rows = pipe.execute()
        out: dict[str, float | None] = {}
        for task_id, (state, at) in zip(task_ids, rows, strict=True):
            ok = state is not None and _text(state) == STARTED and at is not None
            out[task_id] = float(_text(at)) if ok else None
        return out

    def records(self, *, lean: bool = False) -> dict[str, dict[str, Any]]:
        """Every waiting or assigned job: `{task_id: record}`, in admission order.

        `lean` (the leader, every pass): only the fields it reads (`_LEAN`), and the
        message of an admission whose message it already holds is not read again.
        """
        ids = [_text(i) for i in self._r.zrange(self._index, 0, -1)]
        found = self.read(ids, lean=lean)
        return {task_id: found[task_id] for task_id in ids if task_id in found}

    @property
    def index_key(self) -> str:
        """The sorted set of waiting and assigned jobs, scored by admission."""
        return self._index

    @property
    def changed_key(self) -> str:
        """The set of jobs whose record changed since the leader last took it."""
        return self._changed

    def index_and_changes(self) -> tuple[list[str], set[str]]:
        """The index (admission order) and the ids marked changed since the last call, taken
        in one transaction: a change made after it is marked again for the next call."""
        with self._r.pipeline(transaction=True) as pipe:
            pipe.zrange(self._index, 0, -1)
            pipe.smembers(self._changed)
            pipe.delete(self._changed)
            ids, changed, _ = pipe.execute()
        return [_text(i) for i in ids], {_text(i) for i in changed}

    def read(self, ids: list[str], *, lean: bool = True) -> dict[str, dict[str, Any]]:
        """The waiting or assigned records of `ids`; the others leave the index."""
        if not ids:
            return {}
        raws = self._lean(ids) if lean else self._full(ids)
        found: dict[str, dict[str, Any]] = {}
        gone: list[str] = []
        for task_id, raw in zip(ids, raws, strict=True):
            record = self._decode_cached(task_id, raw) if raw else None
            if (
                record is None
                or record.get("state") not in (PENDING, ASSIGNED)
                or "msg" not in record
            ):
                gone.append(task_id)
            else:
                found[task_id] = record
        if gone:
            self._prune(gone)
        return found

    def _prune(self, gone: list[str]) -> None:
        """Drop index entries whose job neither waits nor is assigned *now* (a job put back
        since it was read, `give_back` with `msg`, keeps its entry)."""
        if self._prune_script is not None:
            try:
                self._prune_script(keys=[self._index, *map(self._key, gone)], args=gone)
                return
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except _NO_SCRIPTING:
                self._prune_script = None
        self._r.zrem(self._index, *gone)

    def _full(self, ids: list[str]) -> list[Any]:
        with self._r.pipeline(transaction=False) as pipe:
            for task_id in ids:
                pipe.hgetall(self._key(task_id))
            return list(pipe.execute())

    def _lean(self, ids: list[str]) -> list[Any]:
        """Raw records of `_LEAN` fields, plus `msg` where the cache does not hold it."""
        with self._r.pipeline(transaction=False) as pipe:
            for task_id in ids:
                pipe.hmget(self._key(task_id), *_LEAN)
            rows = pipe.execute()
        raws = [{k: v for k, v in zip(_LEAN, row, strict=True) if v is not None} for row in rows]
        stamps = [(ids[i], _text(raw.get("admitted_at", ""))) for i, raw in enumerate(raws)]
        missing = [i for i, raw in enumerate(raws) if raw and stamps[i] not in self._msgs]
        if missing:
            with self._r.pipeline(transaction=False) as pipe:
                for i in missing:
                    pipe.hget(self._key(ids[i]), "msg")
                for i, msg in zip(missing, pipe.execute(), strict=True):
                    if msg is not None:
                        raws[i]["msg"] = msg
        for i, raw in enumerate(raws):
            if raw and "msg" not in raw and stamps[i] in self._msgs:
                raw["msg"] = _CACHED
        return raws

    def _decode_cached(self, task_id: str, raw: Mapping[Any, Any]) -> dict[str, Any]:
        """`_decode`, reusing the decoded message of an admission already seen (the leader
        reads every record on every pass; the message, the largest field, never changes
        while its admission stands). The cached message is shared: read it, do not modify."""
        fields = {_text(k): v for k, v in raw.items()}
        key = (task_id, _text(fields.get("admitted_at", "")))
        msg = self._msgs.get(key) if "msg" in fields else None
        if msg is None and fields.get("msg") is _CACHED:  # evicted since `_lean`: read it again
            fields["msg"] = self._r.hget(self._key(task_id), "msg") or b"{}"
        if msg is None:
            record = _decode(fields)
            if isinstance(record.get("msg"), dict):
                self._msgs[key] = record["msg"]
            return record
        record = _decode({k: v for k, v in fields.items() if k != "msg"})
        record["msg"] = msg
        return record

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
            args = [worker, token, fields["assigned_at"], fields["victims"], task_id]
            keys = [self._key(task_id), self._changed]
            if push is not None:
                keys, args = [*keys, push[0]], [*args, push[1].decode()]
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

    def annotate(self, notes: Mapping[str, tuple[str, float | None, str | None]]) -> None:
        """RFC 27 annotate: `{task_id: (reason_pending, t_estimate, worker)}` in one round trip."""
        if not notes:
            return
        with self._r.pipeline(transaction=False) as pipe:
            for task_id, (reason, t_est, worker) in notes.items():
                note = {"reason_pending": reason, "t_estimate": t_est, "worker": worker}
                pipe.hset(self._key(task_id), "annotation", json.dumps(note))
            pipe.execute()

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
