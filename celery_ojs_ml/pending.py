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

from celery_ojs_ml.lru import LRU
from celery_ojs_ml.store import OJSStore

PENDING, ASSIGNED, STARTED, CANCELLED = "pending", "assigned", "started", "cancelled"
TOMBSTONE_S = 86400
HEADER_MSG = "ojs_msg"
"""A unique id the publisher stamps on each publish of an ML job (`admit_many`)."""
_SEEN = 32
"""Message ids kept per job: more than any job's re-publishes within its tombstone's day."""
_MSG_CACHE = 20_000
"""Decoded messages the leader keeps between passes (`records`)."""
_LEAN = ("state", "meta", "admitted_at", "worker", "token", "assigned_at", "hold_until",
         "returned_at", "priority", "reason", "victims")  # fmt: skip
"""The fields of a record the leader reads on every pass (`records(lean=True)`)."""
_CACHED = b"\x00cached"
"""Stands for a message `_lean` did not read because the cache holds it."""
_RETRIES = 16
_JSON_FIELDS = ("msg", "meta", "annotation", "victims", "seen")
_NO_SCRIPTING = (redis.ResponseError, ImportError, NotImplementedError)
log = logging.getLogger(__name__)

_START = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'unknown' end
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 'stale' end
if state == 'started' then return 'again' end
if state ~= 'assigned' then return 'stale' end
redis.call('HSET', KEYS[1], 'state', 'started', 'started_at', ARGV[2])
redis.call('HDEL', KEYS[1], 'msg')
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[4])
return 'ok'
"""
"""`start` in one round trip (the gate's hot path); `_start_watched` is the same without Lua."""

_ASSIGN = """
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'assigned', 'worker', ARGV[1], 'token', ARGV[2],
           'assigned_at', ARGV[3], 'victims', ARGV[4])
redis.call('SADD', KEYS[2], ARGV[5])
return 1
"""
"""`assign` in one round trip (the leader's hot path); `_cas` is the same without Lua."""


_ADMIT = """
local now, keep, out = ARGV[1], tonumber(ARGV[2]), {}
for i = 2, #KEYS do
  local a = 3 + (i - 2) * 5
  local task_id, msg, meta, msg_id, score = ARGV[a], ARGV[a+1], ARGV[a+2], ARGV[a+3], ARGV[a+4]
  local state = redis.call('HGET', KEYS[i], 'state')
  local raw = redis.call('HGET', KEYS[i], 'seen')
  local seen = {}
  if raw then seen = cjson.decode(raw) end
  local ok = (not state) or state == 'started'
  if ok and msg_id ~= '' then
    for _, s in ipairs(seen) do
      if s == msg_id then ok = false break end
    end
  end
  if ok then
    if msg_id ~= '' then
      seen[#seen + 1] = msg_id
      while #seen > keep do table.remove(seen, 1) end
    end
    redis.call('DEL', KEYS[i])
    redis.call('HSET', KEYS[i], 'state', 'pending', 'msg', msg, 'meta', meta, 'admitted_at', now)
    if #seen > 0 then redis.call('HSET', KEYS[i], 'seen', cjson.encode(seen)) end
    redis.call('ZADD', KEYS[1], score, task_id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""
"""`admit_many` in one round trip (`_admit_watched` is the same without Lua)."""

_PRUNE = """
for i, task_id in ipairs(ARGV) do
  local state = redis.call('HGET', KEYS[i + 1], 'state')
  if state ~= 'pending' and state ~= 'assigned' then
    redis.call('ZREM', KEYS[1], task_id)
  end
end
return 0
"""
"""`read`'s index pruning, checked again per job at the moment of removal."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _decode(raw: Mapping[Any, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {}
    for key, value in raw.items():
        name = _text(key)
        text = _text(value)
        record[name] = json.loads(text) if name in _JSON_FIELDS else text
    return record


class PendingBook:
    """Pending jobs, assignments and the scheduler lock of one store."""

    def __init__(self, store: OJSStore) -> None:
        self.store = store
        self._r = store.client
        self._index = store.key("pjobs")
        self._changed = store.key("pdirty")
        self.on_admit: Callable[[str, dict[str, Any]], None] = lambda task_id, record: None
        """Told of each record `admit_many` wrote (the leader's `PendingView.put`): the
        only admissions not marked in `pdirty`, as only the leader admits."""
        self._prune_script: Any = self._r.register_script(_PRUNE)
        self._admit_script: Any = self._r.register_script(_ADMIT)
        self._start_script: Any = self._r.register_script(_START)
        self._assign_script: Any = self._r.register_script(_ASSIGN)
        self._leader = store.key("scheduler", "leader")
        self._msgs: LRU[tuple[str, str], dict[str, Any]] = LRU(_MSG_CACHE)

    def _key(self, task_id: str) -> str:
        return self.store.key("pjob", task_id)

    # -- admission ------------------------------------------------------------------------

    def admit(self, task_id: str, meta: dict[str, Any], msg: dict[str, Any]) -> bool:
        """Add a job (its message and metadata); False when it is already known.

        A job re-published under the same id (a crash or preemption) is admitted
        again only once its earlier record was started or is gone.
        """
        return self.admit_many([(task_id, meta, msg)])[0]

    def admit_many(self, jobs: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[bool]:
        """`admit` for a batch in one transaction (the leader drains its intake in batches).

        A message already admitted once (its `ojs_msg` header is in the record's
        `seen` list) is not admitted again: an intake message redelivered after the
        leader that admitted it died (kombu's restore of unacked messages, or the
        Redis intake's processing list) must not re-run a job that started.
        """
        if not jobs:
            return []
        keys = [self._key(task_id) for task_id, _, _ in jobs]
        now = repr(self.store._clock())
        fresh = self._admit_lua(jobs, keys, now)
        if fresh is None:
            fresh = self._admit_watched(jobs, keys, now)
        for (task_id, meta, msg), ok in zip(jobs, fresh, strict=True):
            if ok:  # the leader's next pass needs no read of what it just wrote
                self._msgs[(task_id, now)] = msg
                record = {"state": PENDING, "meta": meta, "admitted_at": now, "msg": msg}
                self.on_admit(task_id, record)
        return fresh

    def _admit_lua(
        self, jobs: list[tuple[str, dict[str, Any], dict[str, Any]]], keys: list[str], now: str
    ) -> list[bool] | None:
        """`admit_many` in one round trip; None where the store runs no Lua."""
        if self._admit_script is None:
            return None
        args: list[Any] = [now, _SEEN]
        for task_id, meta, msg in jobs:
            msg_id = (msg.get("headers") or {}).get(HEADER_MSG)
            score = float(meta.get("submitted_at") or 0.0)
            msg_id = msg_id if isinstance(msg_id, str) else ""
            args += [task_id, json.dumps(msg), json.dumps(meta), msg_id, repr(score)]
        try:
            return [bool(x) for x in self._admit_script(keys=[self._index, *keys], args=args)]
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except _NO_SCRIPTING as exc:
            log.info("ojs-ml: no Lua scripting on the store (%s); admits use MULTI/WATCH", exc)
            self._admit_script = None
            return None

    def _admit_watched(
        self, jobs: list[tuple[str, dict[str, Any], dict[str, Any]]], keys: list[str], now: str
    ) -> list[bool]:
        def txn(pipe: Any) -> list[bool]:
            with self._r.pipeline(transaction=False) as read:
                for key in keys:
                    read.hmget(key, "state", "seen")
                rows = read.execute()
            fresh: list[bool] = []
            pipe.multi()
            for (task_id, meta, msg), key, (state, seen_raw) in zip(jobs, keys, rows, strict=True):
                seen: list[str] = json.loads(_text(seen_raw)) if seen_raw else []
                msg_id = (msg.get("headers") or {}).get(HEADER_MSG)
                ok = (state is None or _text(state) == STARTED) and msg_id not in seen
                fresh.append(ok)
                if not ok:
                    continue
                if isinstance(msg_id, str):
                    seen = [*seen, msg_id][-_SEEN:]
                pipe.delete(key)
                fields = {"state": PENDING, "msg": json.dumps(msg), "meta": json.dumps(meta)}
                pipe.hset(key, mapping={**fields, "admitted_at": now, "seen": json.dumps(seen)})
                pipe.zadd(self._index, {task_id: float(meta.get("submitted_at") or 0.0)})
            return fresh

        return list(self._transaction(keys, txn))

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
    ) -> str | None:
        """`pending` -> `assigned` to `worker` with a fresh token; None if not pending."""
        token = uuid.uuid4().hex
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
            try:
                return token if self._assign_script(keys=keys, args=args) else None
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except _NO_SCRIPTING as exc:
                log.info("ojs-ml: no Lua scripting on the store (%s); assigns use MULTI/WATCH", exc)
                self._assign_script = None
        ok = self._cas(task_id, lambda r: r.get("state") == PENDING, fields)
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

    # -- the scheduler lock ----------------------------------------------------------------

    def lead(self, candidate: str, ttl_s: float) -> bool:
        """Take or renew the scheduler lock; True while `candidate` holds it."""
        ms = max(1, round(ttl_s * 1000))
        mine = self.leader()
        if mine is not None and mine.get("id") == candidate:
            value = json.dumps(mine)

            def txn(pipe: Any) -> bool:
                if _text(pipe.get(self._leader) or b"") != value:
                    return False
                pipe.multi()
                pipe.pexpire(self._leader, ms)
                return True

            return bool(self._transaction(self._leader, txn))
        record = json.dumps({"id": candidate, "since": self.store._clock()})
        return bool(self._r.set(self._leader, record, nx=True, px=ms))

    def resign(self, candidate: str) -> None:
        """Give the lock up at once (a clean shutdown), if `candidate` holds it."""
        mine = self.leader()
        if mine is not None and mine.get("id") == candidate:
            value = json.dumps(mine)

            def txn(pipe: Any) -> None:
                if _text(pipe.get(self._leader) or b"") == value:
                    pipe.multi()
                    pipe.delete(self._leader)

            self._transaction(self._leader, txn)

    def leader(self) -> dict[str, Any] | None:
        """`{id, since}` of the current scheduler, or None."""
        raw = self._r.get(self._leader)
        if raw is None:
            return None
        value = json.loads(_text(raw))
        return value if isinstance(value, dict) else None

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
