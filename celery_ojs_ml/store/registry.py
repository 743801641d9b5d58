"""Redis state shared by every process: live workers, pending and held jobs.

Every key lives under `<prefix>:{ml}:` (the `{ml}` hash tag keeps all keys in one Redis
Cluster slot, so multi-key transactions are legal there); redis-py only, so the same
code runs on one server (alone or behind Sentinel, `store.connect`) and on fakeredis in
the embedded demo. Layout:
`<kind>:<name>` (JSON, PX TTL; kind worker, pending or held) and `index:<kind>` (zset
name -> expiry). The class registry of earlier versions (`class:*`) is only read.

Key decision: liveness is the server's business: a record is its own key with a TTL,
so it vanishes when its owner stops refreshing it; the index is pruned by the client
clock with a generous grace, so skew can delay garbage collection, never hide a record.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis

from celery_ojs_ml.spec.classes import BANDS
from celery_ojs_ml.store import connect
from celery_ojs_ml.store.feed import FED, append, feed_key

Clock = Callable[[], float]
log = logging.getLogger(__name__)

_INDEX_GRACE_MS = 60_000
_SHORT_LOG_S = 60.0
"""How often `OJSStore.replicated` logs that its replicas fell short, while they do."""
NO_SCRIPTING = (redis.ResponseError, ImportError, NotImplementedError)
"""What calling a Lua script raises on a store that runs none (fakeredis without lupa)."""
_INDEXED = """
if ARGV[1] ~= '' then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1]) end
local out = {}
for _, name in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local value = redis.call('GET', ARGV[2] .. name)
  if value then
    out[#out + 1] = name
    out[#out + 1] = value
  end
end
return out
"""
"""`OJSStore.indexed`: an index's members and their values in one round trip."""


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def pairs(flat: list[Any]) -> list[tuple[str, bytes]]:
    """The `indexed` script's flat reply as `(member, value)` pairs."""
    return [(_text(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]


def class_routes(entry: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The (logical queue, band) pairs of a class registry entry (`OJSStore.classes`).

    A logical queue registered without bands (by an older producer) counts in every band.
    """
    routes = [(str(q), str(b)) for q, b in entry.get("routes") or []]
    known = {q for q, _ in routes}
    routes += [(str(q), b) for q in entry.get("queues", []) if q not in known for b in BANDS]
    return routes


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ttl_ms(ttl_s: float) -> int:
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0 seconds, e.g. ttl_s=10.0, but got {ttl_s!r}")
    return max(1, round(ttl_s * 1000))


class OJSStore:
    """Typed access to the celery-ojs-ml records in one Redis database."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "ojs",
        clock: Clock = time.time,
        replicas: int = 0,
        replica_wait_ms: int = 100,
    ) -> None:
        self._r = client
        self._base = f"{prefix}:{{ml}}"
        self._clock = clock
        self._indexed: Any = client.register_script(_INDEXED)
        self.replicas, self.replica_wait_ms = replicas, replica_wait_ms
        """`replicated`: how many replicas to wait for, and for how long at most."""
        self._short_logged = -_SHORT_LOG_S
        self._advertised: dict[str, str] = {}
        """Worker -> its last heartbeat's content as queued here (`advertise_commands`)."""

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "ojs",
        clock: Clock = time.time,
        options: Mapping[str, Any] | None = None,
        origin: str = connect.SETTING,
        replicas: int = 0,
        replica_wait_ms: int = 100,
    ) -> OJSStore:
        """A store on a new client for `url`, e.g. `redis://127.0.0.1:6379/0` or
        `sentinel://10.0.0.5:26379;sentinel://10.0.0.6:26379/0` with `options`
        `{"master_name": "mymaster"}` (`store.connect`; `origin`: the setting the
        options come from, named in errors)."""
        client = connect.connect(connect.Source(url, dict(options or {}), origin))
        return cls(
            client,
            prefix=prefix,
            clock=clock,
            replicas=replicas,
            replica_wait_ms=replica_wait_ms,
        )

    def replicated(self) -> int | None:
        """Wait until `replicas` replicas hold every write made so far, at most
        `replica_wait_ms` (Redis WAIT, after a write on the same connection so that
        it covers every client's writes); the number that confirmed, None when off.

        Called after the writes a failover must not undo (an admission before its
        intake message is settled, an assignment before its delivery, a checkpoint
        commit); short of `replicas` it logs and goes on (docs/operations.md)."""
        if self.replicas <= 0:
            return None
        try:
            with self._r.pipeline(transaction=False) as pipe:
                pipe.incrby(self.key("replicated"), 1)
                pipe.execute_command("WAIT", self.replicas, self.replica_wait_ms)  # type: ignore[no-untyped-call]
                acked = int(pipe.execute()[1])
        except redis.ResponseError as exc:  # no permission, or no WAIT (fakeredis)
            log.warning("ojs-ml: could not wait for the store's replicas: %s", exc)
            return None
        if acked < self.replicas and time.monotonic() >= self._short_logged + _SHORT_LOG_S:
            self._short_logged = time.monotonic()  # once a minute while it lasts
            log.warning(
                "ojs-ml: %d of %d store replicas confirmed the last writes within %d ms; "
                "a failover now could undo them",
                acked,
                self.replicas,
                self.replica_wait_ms,
            )
        return acked

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client."""
        return self._r

    def key(self, *parts: str) -> str:
        """The full key for `parts`, under the prefix and the `{ml}` hash tag."""
        return ":".join((self._base, *parts))

    def lease_key(self, task_id: str) -> str:
        """The key of a running job's lease (store.leases, checked by checkpoint commits)."""
        return self.key("lease", task_id)

    def close(self) -> None:
        """Release the client's connections."""
        self._r.close()

    def ping(self) -> bool:
        """Whether the server answers; never raises."""
        try:
            return bool(self._r.ping())
        except redis.RedisError:
            return False

    # -- the class registry of earlier versions (read only) ------------------------------

    def classes(self) -> dict[str, dict[str, Any]]:
        """Every class a producer of an earlier version registered when it published to a
        per-class queue: `{class_id: {"constraints", "queues", "routes"}}`. Nothing writes
        the registry now; `celery ojs-ml explain` reads it to find jobs left in those queues.

        `queues` are its sorted logical queues; `routes` the sorted
        `[logical queue, band]` pairs jobs were published with.
        """
        raw: dict[Any, Any] = self._r.hgetall(self.key("class", "constraints"))
        ids = sorted(_text(k) for k in raw)
        with self._r.pipeline(transaction=False) as pipe:
            for cid in ids:
                pipe.smembers(self.key("class", "queues", cid))
                pipe.smembers(self.key("class", "routes", cid))
            members = pipe.execute()
        by_id = {_text(k): v for k, v in raw.items()}
        found: dict[str, dict[str, Any]] = {}
        for cid, qs, rs in zip(ids, members[::2], members[1::2], strict=True):
            try:
                found[cid] = {
                    "constraints": json.loads(by_id[cid]),
                    "queues": sorted(_text(q) for q in qs),
                    "routes": sorted(json.loads(_text(r)) for r in rs),
                }
            except (ValueError, TypeError) as exc:  # one corrupt entry must not hide the rest
                log.error("ojs-ml: skipping corrupt class registry entry %s: %s", cid, exc)
        return found

    # -- live workers ------------------------------------------------------------

    def advertise(
        self,
        worker: str,
        capabilities: dict[str, Any],
        free: dict[str, Any],
        *,
        ttl_s: float = 10.0,
        info: dict[str, Any] | None = None,
        held: list[dict[str, Any]] | None = None,
        push: tuple[str, bytes] | None = None,
    ) -> None:
        """Publish a worker's heartbeat; it stays live for `ttl_s` seconds unless refreshed.

        With `held`, the worker's held-jobs snapshot (`set_held`) goes in the same write;
        with `push` (list key, value), an LPUSH too (a wake-up of the scheduler).
        """
        commands = self.advertise_commands(
            worker, capabilities, free, ttl_s=ttl_s, info=info, held=held, push=push
        )
        try:
            with self._r.pipeline(transaction=True) as pipe:
                for command in commands:
                    pipe.execute_command(*command)  # type: ignore[no-untyped-call]
                pipe.execute()
        except Exception:
            self.advertise_failed(worker)
            raise

    def advertise_commands(
        self,
        worker: str,
        capabilities: dict[str, Any],
        free: dict[str, Any],
        *,
        ttl_s: float = 10.0,
        info: dict[str, Any] | None = None,
        held: list[dict[str, Any]] | None = None,
        push: tuple[str, bytes] | None = None,
    ) -> list[tuple[str | bytes | int, ...]]:
        """`advertise`'s writes as Redis commands, for a caller that sends them itself
        (the worker's wake-up, on its lease connection, without waiting for the reply);
        applied in order on one connection, the push comes after the heartbeat."""
        text = _dumps({"capabilities": capabilities, "free": free, "info": info or {}, FED: 1})
        now = self._clock()
        ttl_ms = _ttl_ms(ttl_s)
        # Serialised once (a wake-up sends one per job end): `ts` sorts last, so the
        # heartbeat is the content with it spliced in, as `_dumps` would write it.
        items = [("worker", f'{text[:-1]},"ts":{json.dumps(now)}}}')]
        if held is not None:
            items.append(("held", _dumps(held)))
        commands: list[tuple[str | bytes | int, ...]] = []
        for kind, value in items:
            commands.append(("SET", self.key(kind, worker), value, "PX", ttl_ms))
            commands.append(("ZADD", self.key("index", kind), round(now * 1000) + ttl_ms, worker))
        if self._advertised.get(worker) != text:
            self._advertised[worker] = text
            commands.append(append(self.worker_feed, worker))
        if push is not None:
            commands.append(("LPUSH", push[0], push[1]))
        return commands

    @property
    def worker_feed(self) -> str:
        """The feed of heartbeats whose content changed (`store.feed`)."""
        return feed_key(self._base, "worker")

    def advertise_failed(self, worker: str) -> None:
        """A heartbeat may not have been written: the next one goes to the feed."""
        self._advertised.pop(worker, None)

    def live_workers(self) -> dict[str, dict[str, Any]]:
        """`{worker: {"capabilities", "free", "info", "ts"}}` for every unexpired heartbeat."""
        return self._live("worker")

    def forget_worker(self, worker: str) -> None:
        """Drop a worker at once, e.g. on a clean shutdown."""
        self._drop("worker", worker)

    # -- pending records ---------------------------------------------------------

    def set_pending(self, task_id: str, record: dict[str, Any], *, ttl_s: float = 86400) -> None:
        """Record why a job waits: `reason`, `class_id`, `queue`, `since` (default: now)."""
        self._put("pending", task_id, {"since": self._clock(), **record}, ttl_s)

    def clear_pending(self, task_id: str) -> None:
        """Forget a job's pending record, e.g. once a worker starts it."""
        self._drop("pending", task_id)

    def pending(self) -> dict[str, dict[str, Any]]:
        """`{task_id: record}` for every unexpired pending record."""
        return self._live("pending")

    # -- worker-local held jobs --------------------------------------------------

    def set_held(self, worker: str, held: list[dict[str, Any]], *, ttl_s: float = 10.0) -> None:
        """Snapshot the jobs `worker` holds in its gate; replaces the previous snapshot."""
        self._put("held", worker, held, ttl_s)

    def held(self) -> dict[str, list[dict[str, Any]]]:
        """`{worker: [held job, ...]}` for every unexpired snapshot."""
        return self._live("held")

    # -- expiring records: one key with a PX TTL plus an index by expiry ----------

    def _put(self, kind: str, name: str, payload: Any, ttl_s: float) -> None:
        self._put_many([(kind, name, payload)], ttl_s)

    def _put_many(
        self,
        items: list[tuple[str, str, Any]],
        ttl_s: float,
        push: tuple[str, bytes] | None = None,
    ) -> None:
        ttl_ms = _ttl_ms(ttl_s)
        expires_ms = round(self._clock() * 1000) + ttl_ms
        with self._r.pipeline(transaction=True) as pipe:
            for kind, name, payload in items:
                pipe.set(self.key(kind, name), _dumps(payload), px=ttl_ms)
                pipe.zadd(self.key("index", kind), {name: expires_ms})
            if push is not None:
                pipe.lpush(push[0], push[1])
            pipe.execute()

    def _drop(self, kind: str, name: str) -> None:
        with self._r.pipeline(transaction=True) as pipe:
            pipe.delete(self.key(kind, name))
            pipe.zrem(self.key("index", kind), name)
            pipe.execute()

    def live_read(self, kind: str) -> tuple[str, str, int]:
        """`(index, key prefix, cutoff in ms)` of the `indexed` read behind `_live(kind)`."""
        cutoff = round(self._clock() * 1000) - _INDEX_GRACE_MS
        return self.key("index", kind), self.key(kind, ""), cutoff

    @property
    def indexed_sha(self) -> str | None:
        """The SHA1 of the `indexed` script (for a caller's pipeline); None: no Lua."""
        return None if self._indexed is None else str(self._indexed.sha)

    def _live(self, kind: str) -> dict[str, Any]:
        index, prefix, cutoff = self.live_read(kind)
        found = self.indexed(index, prefix, cutoff)
        if found is not None:
            return {name: json.loads(value) for name, value in found}
        with self._r.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(index, "-inf", cutoff)
            pipe.zrange(index, 0, -1)
            raw: list[Any] = pipe.execute()[1]
        names = [_text(n) for n in raw]
        if not names:
            return {}
        values: list[Any] = self._r.mget([self.key(kind, n) for n in names])
        return {n: json.loads(v) for n, v in zip(names, values, strict=True) if v is not None}

    def indexed(
        self, index: str, prefix: str, cutoff_ms: int | None = None
    ) -> list[tuple[str, bytes]] | None:
        """`(member, value of prefix + member)` for each member of the sorted set `index`
        whose key exists, in index order, after dropping members scored below
        `cutoff_ms`: one round trip (the leader reads workers and leases every pass).
        None where the store runs no Lua (then read the index, then the keys)."""
        if self._indexed is None:
            return None
        try:
            flat: list[Any] = self._indexed(keys=[index], args=[cutoff_ms or "", prefix])
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except NO_SCRIPTING as exc:
            log.info("ojs-ml: no Lua scripting on the store (%s); reads use two round trips", exc)
            self._indexed = None
            return None
        return pairs(flat)
