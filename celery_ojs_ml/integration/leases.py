"""Leases of running ML jobs (DESIGN decision 4): Redis records, not unacked messages.

Key decisions:
* When the gate starts an ML job it writes a lease (the job's task name,
  arguments, canonical headers, retries, worker, allocation and a deadline)
  and only then acks the broker message. So a multi-hour job is never
  redelivered by Redis' `visibility_timeout` and never trips RabbitMQ's
  `consumer_timeout`, and a crash loses nothing: the lease outlives the worker.
* A lease is a plain key without TTL plus a sorted-set index by deadline, so an
  expired lease is still readable by whoever claims it. The owner refreshes the
  deadline by heartbeat; a claim is a WATCH/MULTI compare-and-set on the lease
  (no Lua, so fakeredis works), which makes exactly one claimer win.
* The two writes on every job's hot path, take and release, go through a
  `LeaseWriter`. In a worker with an event loop (prefork) it batches them: a
  lease is written once its job has run for a short delay (2 ms on an idle
  worker, `ojs_ml_lease_write_delay_ms` on a busy one), together with every
  queued release, as one Lua call (releases token-checked, as below) on a
  connection of its own, so the write is off the task's start-up path and
  costs one round trip per batch. The broker message is acked only when its
  lease is written; a job that finishes before that needs no lease at all.
  Without an event loop (threads pool, the embedded demo) each write is made at
  once. Where the server has no scripting (fakeredis without lupa) writes fall
  back to a MULTI pipeline and the compare-and-set.
* Every write carries a random token; release and refresh only touch a lease
  whose token is still theirs, so a late release by a dead incarnation (or by
  the claimer, after the re-published job already started elsewhere and wrote
  its own lease) never deletes someone else's lease.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import redis

from celery_ojs_ml.store import OJSStore

log = logging.getLogger(__name__)
_RETRIES = 16
_RELEASE = """
local raw = redis.call('GET', KEYS[1])
if not raw then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
local ok, lease = pcall(cjson.decode, raw)
if ok and type(lease) == 'table' and lease['token'] == ARGV[2] then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 1
end
return 0
"""
_BATCH = """
local takes = tonumber(ARGV[1])
local a = 2
for i = 1, takes do
  redis.call('SET', KEYS[1 + i], ARGV[a + 1])
  redis.call('ZADD', KEYS[1], ARGV[a + 2], ARGV[a])
  a = a + 3
end
local released = 0
for i = takes + 1, #KEYS - 1 do
  local id, token = ARGV[a], ARGV[a + 1]
  a = a + 2
  local raw = redis.call('GET', KEYS[1 + i])
  if not raw then
    redis.call('ZREM', KEYS[1], id)
  else
    local ok, lease = pcall(cjson.decode, raw)
    if ok and type(lease) == 'table' and lease['token'] == token then
      redis.call('DEL', KEYS[1 + i])
      redis.call('ZREM', KEYS[1], id)
      released = released + 1
    end
  end
end
return released
"""
_NO_SCRIPTING = (redis.ResponseError, ImportError, NotImplementedError)


class LeaseBook:
    """Lease records of one store; every method is safe to call from any worker."""

    def __init__(self, store: OJSStore, ttl_s: float) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._r = store.client
        self._index = store.key("leases")
        self._scripts: dict[str, Any] | None = {
            "release": self._r.register_script(_RELEASE),
            "batch": self._r.register_script(_BATCH),
        }

    def _script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run a hot-path script; None when the server cannot (then use the fallback)."""
        if self._scripts is None:
            return None
        try:
            return self._scripts[name](keys=keys, args=args)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except _NO_SCRIPTING as exc:
            log.info("ojs-ml: no Lua scripting on the store (%s); leases use MULTI/WATCH", exc)
            self._scripts = None
            return None

    def _key(self, task_id: str) -> str:
        return self.store.lease_key(task_id)

    def _now(self) -> float:
        return float(self.store._clock())

    def new_lease(
        self, record: dict[str, Any], token: str | None = None
    ) -> tuple[str, tuple[str, str, float]]:
        """The token (fresh unless given) and `(task_id, json, deadline)` take of a job.

        Raises TypeError/ValueError when the record is not JSON.
        """
        token = token or uuid.uuid4().hex
        deadline = self._now() + self.ttl_s
        payload = json.dumps({**record, "token": token, "deadline": deadline})
        return token, (record["task_id"], payload, deadline)

    def take(self, record: dict[str, Any], token: str | None = None) -> str:
        """Write (or overwrite) the lease of a job starting now; returns its token.

        `token` keeps a lease's existing token (a lease written again after it vanished).
        """
        token, lease = self.new_lease(record, token)
        self.write_batch([lease], [])
        return token

    def get(self, task_id: str) -> dict[str, Any] | None:
        """The lease of a job, or None."""
        raw = self._r.get(self._key(task_id))
        return json.loads(raw) if raw else None

    def all(self) -> list[dict[str, Any]]:
        """Every lease (running, expired or being claimed)."""
        members: list[Any] = self._r.zrange(self._index, 0, -1)
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in members]
        if not ids:
            return []
        values = self._r.mget([self._key(i) for i in ids])
        return [json.loads(v) for v in values if v]

    def refresh(self, tokens: dict[str, str]) -> tuple[list[str], list[str]]:
        """Push the deadlines of our leases.

        Returns `(taken_over, missing)`: the task ids whose lease now carries
        another token (a claimer took the job over) and those with no lease at
        all (lost with the store, or released by the copy that took over).
        """
        if not tokens:
            return [], []
        ids = list(tokens)
        values = self._r.mget([self._key(i) for i in ids])
        taken: list[str] = []
        missing: list[str] = []
        deadline = self._now() + self.ttl_s
        with self._r.pipeline(transaction=False) as pipe:
            for task_id, raw in zip(ids, values, strict=True):
                lease = json.loads(raw) if raw else None
                if lease is None:
                    missing.append(task_id)
                    continue
                if lease.get("token") != tokens[task_id]:
                    taken.append(task_id)
                    continue
                lease["deadline"] = deadline
                pipe.set(self._key(task_id), json.dumps(lease))
                pipe.zadd(self._index, {task_id: deadline})
            pipe.execute()
        return taken, missing

    def release(self, task_id: str, token: str) -> bool:
        """Delete a lease if it is still the one with `token`."""
        done = self._script("release", [self._key(task_id), self._index], [task_id, token])
        if done is not None:
            return bool(done)
        return self._cas(task_id, lambda lease: lease.get("token") == token, None) is not None

    @property
    def batch_sha(self) -> str | None:
        """SHA1 of the batch script; None where the store has no scripting."""
        return None if self._scripts is None else str(self._scripts["batch"].sha)

    def load_scripts(self) -> None:
        """Load the batch script now, so that a bare EVALSHA finds it."""
        if self._scripts is not None:
            self._r.script_load(_BATCH)

    def batch_arguments(
        self, takes: list[tuple[str, str, float]], releases: list[tuple[str, str]]
    ) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the batch script."""
        keys = [self._index]
        args: list[Any] = [len(takes)]
        for task_id, payload, deadline in takes:
            keys.append(self._key(task_id))
            args += [task_id, payload, deadline]
        for task_id, token in releases:
            keys.append(self._key(task_id))
            args += [task_id, token]
        return keys, args

    def write_batch(
        self, takes: list[tuple[str, str, float]], releases: list[tuple[str, str]]
    ) -> bool:
        """Write leases `(task_id, json, deadline)` and release `(task_id, token)` at once.

        One Lua call (one round trip, one reply to parse), atomic like a
        MULTI/EXEC. Returns whether the takes were written; raises when the
        store is unreachable (the caller keeps the messages unacked).
        """
        keys, args = self.batch_arguments(takes, releases)
        if self._script("batch", keys, args) is not None:
            return True
        return self._write_one_by_one(takes, releases)

    def _release_again(self, task_id: str, token: str, error: Exception) -> None:
        """A batched release failed (NOSCRIPT after a server restart, or no Lua): retry it."""
        try:
            self.release(task_id, token)
        except Exception as exc:
            log.warning("ojs-ml: could not release the lease of %s: %s (%s)", task_id, exc, error)

    def _write_one_by_one(
        self, takes: list[tuple[str, str, float]], releases: list[tuple[str, str]]
    ) -> bool:
        with self._r.pipeline(transaction=True) as pipe:
            for task_id, payload, deadline in takes:
                pipe.set(self._key(task_id), payload)
                pipe.zadd(self._index, {task_id: deadline})
            if takes:
                pipe.execute()
        for task_id, token in releases:
            self._release_again(task_id, token, RuntimeError("no scripting"))
        return True

    def expired(self) -> list[str]:
        """Task ids whose lease deadline has passed."""
        raw: list[Any] = self._r.zrangebyscore(self._index, "-inf", self._now())
        return [i.decode() if isinstance(i, bytes) else str(i) for i in raw]

    def claim(
        self, task_id: str, claimer: str, incarnation: str, *, stale_owner: str | None = None
    ) -> dict[str, Any] | None:
        """Atomically take over an expired lease (or a stale one of `stale_owner`).

        Returns the lease as it was (the job to re-publish) with the claimer's
        new token in `claim_token`, or None when someone else won or it is live.
        """
        now = self._now()

        def claimable(lease: dict[str, Any]) -> bool:
            if stale_owner is not None:
                return bool(
                    lease.get("worker") == stale_owner and lease.get("incarnation") != incarnation
                )
            return float(lease.get("deadline", 0)) < now

        token = uuid.uuid4().hex
        before = self._cas(
            task_id,
            claimable,
            lambda lease: {
                **lease,
                "worker": claimer,
                "incarnation": incarnation,
                "token": token,
                "deadline": now + self.ttl_s,
                "claimed_from": lease.get("worker"),
            },
        )
        return None if before is None else {**before, "claim_token": token}

    def stale_of(self, worker: str, incarnation: str) -> list[str]:
        """Leases a previous incarnation of `worker` left behind (Flux `sched-hello`)."""
        return [
            lease["task_id"]
            for lease in self.all()
            if lease.get("worker") == worker and lease.get("incarnation") != incarnation
        ]

    def _cas(self, task_id: str, test: Any, update: Any) -> dict[str, Any] | None:
        """If `test(lease)`, replace it by `update(lease)` (or delete when None); else None."""
        key = self._key(task_id)
        for _ in range(_RETRIES):
            with self._r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]
                    raw = pipe.get(key)
                    lease = json.loads(raw) if raw else None
                    if lease is None or not test(lease):
                        pipe.unwatch()
                        if lease is None:
                            self._r.zrem(self._index, task_id)
                        return None
                    pipe.multi()
                    new = update(lease) if update is not None else None
                    if new is None:
                        pipe.delete(key)
                        pipe.zrem(self._index, task_id)
                    else:
                        pipe.set(key, json.dumps(new))
                        pipe.zadd(self._index, {task_id: new["deadline"]})
                    pipe.execute()
                    return dict(lease)
                except redis.WatchError:
                    continue
        log.warning("ojs-ml: lease %s is contended; giving up this round", task_id)
        return None


Batch = tuple[list[tuple[str, str, float]], list[tuple[str, str]], list[Callable[[bool], None]]]
"""Takes `(task_id, json, deadline)`, releases `(task_id, token)` and the takes' callbacks."""

Record = dict[str, Any] | Callable[[], dict[str, Any]]
"""A lease record, or a function that builds it (called only if the lease is written)."""

IDLE_DELAY_S = 0.002
"""How long a job runs before its lease is written, on a worker that took no lease in
the last `BUSY_WINDOW_S`."""
BUSY_DELAY_S = 0.020
"""The same on a busy worker (`ojs_ml_lease_write_delay_ms`): one batch serves the jobs
of many milliseconds, and a job that ends sooner needs no lease write at all."""
BUSY_WINDOW_S = 0.050


class LeaseWriter:
    """The hot-path lease writes of one worker: batched under an event loop (module doc).

    Each take is due `IDLE_DELAY_S` after it was queued on a worker that took
    no lease for `BUSY_WINDOW_S`, and `busy_delay_s` after on a busy one (the
    smaller of the two when idle). `defer(fn, delay_s)` schedules `fn` on the
    worker's event loop `delay_s` from now; then one timer at a time sends the
    takes that are due, with every queued release, and is set again for the
    next take due. So a lease exists once its job has run for the delay, and
    a job that ends sooner costs no write. Without `defer` every write is
    made at once. With `loop` (the worker's kombu hub) a batch is sent on a
    connection of its own, packed here, and its reply is read when the loop
    sees it arrive, so the event loop never sits waiting for the store. Not
    thread-safe when deferring: under prefork every call comes from the loop.
    """

    def __init__(
        self,
        book: LeaseBook,
        defer: Callable[[Callable[[], None], float], Any] | None = None,
        loop: Any = None,
        busy_delay_s: float = BUSY_DELAY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.book = book
        self._defer = defer
        self._clock = clock
        self._delays = (min(IDLE_DELAY_S, busy_delay_s), busy_delay_s)
        self._loop = loop if defer is not None else None
        self._takes: dict[str, tuple[str, Record, Callable[[bool], None], float]] = {}
        """token -> (task id, record, written, due); due times never decrease."""
        self._releases: list[tuple[str, str]] = []
        self._timer_at: float | None = None
        self._last_take = -1e9
        self._conn: Any = None
        self._fd: int | None = None
        self._inflight: deque[Batch] = deque()
        self._tokens = map(f"{uuid.uuid4().hex}-{{}}".format, itertools.count())

    def take(self, task_id: str, record: Record, written: Callable[[bool], None]) -> str:
        """Queue the lease of a job starting now; returns its token.

        `written(ok)` is called once: True when the lease is written (or the
        job finished before it had to be), False when the store failed or the
        record is not JSON (its broker message then keeps holding the job).
        A `record` function runs when the lease is written, so a job that ends
        before then costs no record at all.
        """
        token: str = next(self._tokens)
        if self._defer is None:
            built = self._build(task_id, token, record)
            written(built is not None and self._write([built], []))
            return token
        now = self._clock()
        due = now + self._delays[now - self._last_take < BUSY_WINDOW_S]
        self._last_take = now
        self._takes[token] = (task_id, record, written, due)
        self._schedule(due)
        return token

    def release(self, task_id: str, token: str) -> None:
        """Queue the release of a finished job's lease (token-checked)."""
        queued = self._takes.pop(token, None)
        if queued is not None:  # finished before its lease was written: nothing to write
            queued[2](True)
            return
        if self._defer is None:
            self._write([], [(task_id, token)])
            return
        self._releases.append((task_id, token))
        now = self._clock()  # sent with the next batch; soon on an idle worker
        self._schedule(now + self._delays[now - self._last_take < BUSY_WINDOW_S])

    def pending(self) -> int:
        """Queued writes not yet sent, plus batches sent whose reply has not been read."""
        return len(self._takes) + len(self._releases) + len(self._inflight)

    def flush(self, wait: bool = False) -> None:
        """Send every queued write now; with `wait`, also wait for every reply.

        The worker waits before its lease heartbeat (which must see the new
        leases) and at stop.
        """
        self._send_due(None)
        if wait:
            self._drain()

    def _on_timer(self, at: float) -> None:
        if self._timer_at == at:
            self._timer_at = None
        self._send_due(self._clock())

    def _send_due(self, now: float | None) -> None:
        """Send the takes due by `now` (all when None) and every queued release."""
        takes: list[tuple[str, tuple[str, Record, Callable[[bool], None], float]]] = []
        for token, queued in self._takes.items():
            if now is not None and queued[3] > now:
                break  # due times never decrease: the rest are later
            takes.append((token, queued))
        for token, _ in takes:
            del self._takes[token]
        releases, self._releases = self._releases, []
        if takes or releases:
            leases: list[tuple[str, str, float]] = []
            callbacks: list[Callable[[bool], None]] = []
            for token, (task_id, record, written, _) in takes:
                built = self._build(task_id, token, record)
                if built is None:
                    written(False)
                    continue
                leases.append(built)
                callbacks.append(written)
            batch: Batch = (leases, releases, callbacks)
            if (leases or releases) and not self._send(batch):
                self._finish(batch, self._write(batch[0], batch[1]))
        if self._takes:
            self._schedule(next(iter(self._takes.values()))[3])

    def _build(self, task_id: str, token: str, record: Record) -> tuple[str, str, float] | None:
        """The `(task_id, json, deadline)` take; None (logged) when the record is not JSON."""
        try:
            return self.book.new_lease(record() if callable(record) else record, token)[1]
        except (TypeError, ValueError) as exc:
            log.warning(
                "ojs-ml: no lease for %s: its record is not JSON (%s); its broker message "
                "holds it until it ends",
                task_id,
                exc,
            )
            return None

    def _schedule(self, due: float) -> None:
        """Make sure a timer fires by `due` (a stale later timer only finds less to send)."""
        if self._defer is None or (self._timer_at is not None and self._timer_at <= due):
            return
        self._timer_at = due
        self._defer(lambda: self._on_timer(due), max(0.0, due - self._clock()))

    def _write(self, takes: list[tuple[str, str, float]], releases: list[tuple[str, str]]) -> bool:
        try:
            return self.book.write_batch(takes, releases)
        except Exception as exc:  # store outage: messages stay unacked, leases expire
            log.warning(
                "ojs-ml: could not write %d lease(s) and release %d: %s",
                len(takes),
                len(releases),
                exc,
            )
            return False

    @staticmethod
    def _finish(batch: Batch, ok: bool) -> None:
        for written in batch[2]:
            written(ok)

    # -- replies read by the event loop -------------------------------------------------------

    def _send(self, batch: Batch) -> bool:
        """Send `batch` without waiting for its reply; False when it must go synchronously."""
        conn = self._connection()
        if conn is None:
            return False
        keys, args = self.book.batch_arguments(batch[0], batch[1])
        try:
            packed = pack_command("EVALSHA", self.book.batch_sha, len(keys), *keys, *args)
            conn.send_packed_command([packed])  # a list: redis-py iterates it
        except Exception as exc:
            self._lost(exc)
            return False
        self._inflight.append(batch)
        return True

    def _connection(self) -> Any:
        if self._loop is None:
            return None
        if self._conn is not None:
            return self._conn
        pool = getattr(self.book.store.client, "connection_pool", None)
        if pool is None or self.book.batch_sha is None:
            self._loop = None  # a cluster client or no scripting: synchronous writes
            return None
        try:
            self.book.load_scripts()
            conn = pool.make_connection()
            conn.connect()
            self._fd = conn._sock.fileno()
            self._loop.add_reader(self._fd, self._on_readable)
        except Exception as exc:
            log.warning("ojs-ml: lease writes wait for their replies (%s)", exc)
            self._loop = None
            return None
        self._conn = conn
        return conn

    def _on_readable(self) -> None:
        """The event loop saw replies arrive: settle every batch whose reply is in."""
        try:
            while self._inflight and self._conn is not None and self._conn.can_read(timeout=0):
                self._settle_one()
        except Exception as exc:
            self._lost(exc)

    def _drain(self) -> None:
        try:
            while self._inflight and self._conn is not None:
                self._settle_one()
        except Exception as exc:
            self._lost(exc)

    def _settle_one(self) -> None:
        try:
            self._conn.read_response()
        except redis.ResponseError as exc:  # NOSCRIPT after a server restart, or a script error
            batch = self._inflight.popleft()
            log.info("ojs-ml: a batched lease write failed (%s); writing it again", exc)
            self._finish(batch, self._write(batch[0], batch[1]))
            return
        self._finish(self._inflight.popleft(), True)

    def _lost(self, exc: Exception) -> None:
        """The connection broke: forget it; batches without a reply are written again."""
        log.warning(
            "ojs-ml: lease connection lost (%s); writing %d batch(es) again",
            exc,
            len(self._inflight),
        )
        self.close()
        while self._inflight:
            batch = self._inflight.popleft()
            self._finish(batch, self._write(batch[0], batch[1]))  # writes are idempotent

    def close(self) -> None:
        """Drop the writer's own connection (the next batch opens another)."""
        conn, self._conn = self._conn, None
        if self._fd is not None and self._loop is not None:
            with contextlib.suppress(Exception):  # the loop may be gone at shutdown
                self._loop.remove_reader(self._fd)
        self._fd = None
        if conn is not None:
            conn.disconnect()


def pack_command(*args: str | bytes | int | float | None) -> bytes:
    """One Redis command in RESP, as redis-py would send it (UTF-8, numbers by `repr`).

    The lease batch is the one command the worker sends per few jobs; packing
    it here costs a fraction of redis-py's general packer.
    """
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        else:
            data = repr(arg).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


def republish_headers(
    headers: dict[str, Any], **counters: int | dict[str, Any] | None
) -> dict[str, Any]:
    """Canonical headers for a re-published copy, with updated counters."""
    keep = {
        k: v for k, v in headers.items() if k.startswith(("ext_ml", "ojs_")) and k not in _TRANSIENT
    }
    keep.update({k: v for k, v in counters.items() if v is not None})
    return keep


_TRANSIENT = frozenset(
    {"ojs_devices", "ojs_node", "ojs_pin", "ojs_pending", "ojs_class", "ojs_band", "ojs_lease"}
)
