"""Grants in the store: who holds which class (`scheduler.grants` says when to grant).

One hash, `<prefix>:{ml}:grants`: field `grant_key(queue, band, class)` -> `worker TAB
epoch`, written by the leader (`issue`, `revoke`), read by publishers (`lookup`) and by
each holder (`mine`). A job published under a grant carries its epoch (`ojs_grant`),
and the holder's gate runs it only while that epoch is still its grant.

Key decision: a publisher keeps a copy of the hash that Redis invalidates (`GrantWatch`,
`CLIENT TRACKING ... BCAST` on a connection of its own), polled without blocking before
each lookup, so the copy answers as an HGET sent then would, without the round trip;
anything unusual drops the copy and the caller reads the field itself.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Any

import redis

from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h

log = logging.getLogger(__name__)

HEADER_GRANT = h.GRANT
"""The epoch of the grant a job was published under (absent: admitted as usual)."""
HEADER_GRANT_AT = h.GRANT_AT
"""When a job was published under a grant (seconds since the epoch): the leader takes a
holder's queued jobs back once the oldest has waited `ojs_ml_grant_wait_s`."""
_RETRY_S = 5.0
"""After a failure, how long lookups read the store before the watch connects again."""
_SOCKET_TIMEOUT_S = 1.0
CLIENT_NAME = "ojs-ml-grant-watch"
"""The watch connection's name in `CLIENT LIST`."""


def _split(raw: Any) -> tuple[str, str] | None:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    worker, sep, epoch = text.partition("\t")
    return (worker, epoch) if sep and worker and epoch else None


def grants_usable(app: Any) -> bool:
    """Whether this app's publishers and leader use grants: `ojs_ml_grants` on, no
    fair-share weights (fair order is not the leader's first-come placement), and a Redis
    broker that is also the store (the leader takes queued jobs back off the broker's
    lists, `redis_intake.sweep_granted`)."""
    from celery_ojs_ml.store.broker import wake_list
    from celery_ojs_ml.wire.queues import intake_name

    settings = app.ojs_ml.settings
    if not settings.grants or settings.fair_share:
        return False
    return wake_list(app, intake_name(settings.store_prefix)) is not None


def queue_grantable(settings: Any, logical: str) -> bool:
    """Whether jobs of `logical` may be granted: its queue policy sets no budget."""
    policy = settings.queue_policies.get(logical)
    if policy is None:
        return True
    limits = policy.ml_limits
    return limits.max_total_gpus is None and limits.max_concurrent_gpu_jobs is None


class GrantWatch:
    """The grants hash `key` of `client`'s server, read once and re-read on change."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self._client = client
        self._key = key
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = 0
        self._grants: dict[str, str] | None = None
        self._retry_at = 0.0
        self._supported = True

    def lookup(self, field: str) -> tuple[bool, str | None]:
        """(True, the value of `field` or None where it has none), or (False, None) when
        the watch cannot vouch for its copy: read the store yourself."""
        with self._lock:
            if not self._watching():
                return False, None
            try:
                if self._changed() or self._grants is None:
                    self._grants = self._read_all()
            except Exception as exc:  # a broken connection: read the store meanwhile
                self._drop(f"the grants watch failed ({exc!r})")
                return False, None
            return True, self._grants.get(field)

    def close(self) -> None:
        """Close the watch connection (lookups connect again when next called)."""
        with self._lock:
            self._drop(None, retry=False)

    def _watching(self) -> bool:
        if self._conn is not None and self._pid != os.getpid():
            self._conn, self._grants = None, None  # forked: the parent's socket stays its own
        if self._conn is not None:
            return True
        if not self._supported or time.monotonic() < self._retry_at:
            return False
        try:
            self._conn = self._connect()
        except redis.ResponseError as exc:  # the server has no CLIENT TRACKING
            self._supported = False
            log.info("ojs-ml: publishers read grants per job (no key tracking: %s)", exc)
            return False
        except Exception as exc:
            self._drop(f"could not watch the grants ({exc!r})")
            return False
        self._pid, self._grants = os.getpid(), None
        return True

    def _connect(self) -> Any:
        pool: Any = self._client.connection_pool
        if not hasattr(pool, "connection_class"):
            raise redis.ResponseError("not a redis-py connection pool")
        kwargs = {**pool.connection_kwargs, "socket_timeout": _SOCKET_TIMEOUT_S}
        conn = pool.connection_class(**kwargs)
        conn.connect()
        try:
            conn.send_command("CLIENT", "SETNAME", CLIENT_NAME)
            conn.read_response()
            if str(getattr(conn, "protocol", 2)) == "3":  # invalidations come as pushes
                conn.send_command("CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", self._key)
                conn.read_response()
            else:  # RESP2: redirected to this connection, subscribed to them
                conn.send_command("CLIENT", "ID")
                own = conn.read_response()
                conn.send_command(
                    "CLIENT", "TRACKING", "ON", "REDIRECT", own, "BCAST", "PREFIX", self._key
                )
                conn.read_response()
                conn.send_command("SUBSCRIBE", "__redis__:invalidate")
                conn.read_response()
        except Exception:
            conn.disconnect()
            raise
        return conn

    def _changed(self) -> bool:
        """Read every invalidation waiting on the connection; whether there was one."""
        changed = False
        while self._conn.can_read(0):
            self._conn.read_response(push_request=True)
            changed = True
        return changed

    def _read_all(self) -> dict[str, str]:
        raw: dict[Any, Any] = self._client.hgetall(self._key)
        return {_text(f): _text(v) for f, v in raw.items()}

    def _drop(self, why: str | None, *, retry: bool = True) -> None:
        if why is not None:
            log.warning("ojs-ml: %s; publishers read grants per job for %.0f s", why, _RETRY_S)
        conn, self._conn, self._grants = self._conn, None, None
        if retry:
            self._retry_at = time.monotonic() + _RETRY_S
        if conn is not None:
            try:
                conn.disconnect()
            except Exception as exc:  # already gone
                log.debug("ojs-ml: closing the grants watch: %r", exc)


class GrantBook:
    """The grants hash of one store."""

    def __init__(self, store: OJSStore) -> None:
        self.store = store
        self.key = store.key("grants")
        self._watch: GrantWatch | None = None

    def lookup(self, field: str) -> tuple[str, str] | None:
        """(worker, epoch) of the grant for `field`, or None: from a copy of the hash that
        Redis invalidates (`GrantWatch`), else one HGET."""
        if self._watch is None:
            self._watch = GrantWatch(self.store.client, self.key)
        known, value = self._watch.lookup(field)
        raw: Any = value if known else self.store.client.hget(self.key, field)
        return None if raw is None else _split(raw)

    def close(self) -> None:
        """Close the lookup's watch connection, if one was opened."""
        if self._watch is not None:
            self._watch.close()

    def all(self) -> dict[str, tuple[str, str]]:
        """Every grant: field -> (worker, epoch)."""
        raw: dict[Any, Any] = self.store.client.hgetall(self.key)
        out: dict[str, tuple[str, str]] = {}
        for field, value in raw.items():
            found = _split(value)
            if found is not None:
                out[field.decode() if isinstance(field, bytes) else str(field)] = found
        return out

    def mine(self, worker: str) -> dict[str, str]:
        """The grants `worker` holds: field -> epoch."""
        return {f: epoch for f, (w, epoch) in self.all().items() if w == worker}

    def issue(self, grants: dict[str, str]) -> dict[str, tuple[str, str]]:
        """Record `grants` (field -> worker), each with a new epoch; returns what was written."""
        written = {f: (w, uuid.uuid4().hex[:12]) for f, w in grants.items()}
        if written:
            self.store.client.hset(
                self.key, mapping={f: f"{w}\t{e}" for f, (w, e) in written.items()}
            )
        return written

    def revoke(self, fields: list[str]) -> None:
        """Forget `fields` (publishers route those classes to the intake again)."""
        if fields:
            self.store.client.hdel(self.key, *fields)


_SCAN_LIMIT = 10_000
"""Messages read from the head of each holder's queue when looking for a task id."""


def locate_granted(plugin: Any, task_id: str) -> tuple[str, str, int] | None:
    """Where a job sent under a grant waits: (holder, grant field, jobs queued before it;
    -1 when held at the holder's gate), or None. Reads the next `_SCAN_LIMIT` messages of
    each holder's queue, then the messages workers took and did not acknowledge yet."""
    from celery_ojs_ml.store import broker as redis_intake
    from celery_ojs_ml.wire.queues import worker_queue_name

    grants = plugin.grant_book.all()
    if not grants:
        return None
    prefix = plugin.settings.store_prefix
    with plugin.app.connection_for_read() as conn:
        if conn.transport.driver_type != "redis":
            return None
        channel = conn.default_channel
        for field, (worker, _) in sorted(grants.items()):
            ahead = 0
            for key in redis_intake.queue_keys(channel, worker_queue_name(prefix, worker)):
                items = channel.client.lrange(key, -_SCAN_LIMIT, -1)  # BRPOP takes the right
                for index, raw in enumerate(items):
                    if _task_id_of(raw) == task_id:
                        return worker, field, ahead + len(items) - 1 - index
                ahead += len(items)
        taken = _taken_by(channel, task_id)  # held at a gate, or waiting in a pool
    for field, (worker, _) in sorted(grants.items()):
        if taken == worker_queue_name(prefix, worker):
            return worker, field, -1
    return None


def _taken_by(channel: Any, task_id: str) -> str | None:
    """The queue a worker took `task_id` from and has not acknowledged yet (kombu's
    unacked hash: `[message, exchange, routing key]` by delivery tag), or None."""
    key = str(getattr(channel, "global_keyprefix", "") or "") + channel.unacked_key
    for _tag, payload in channel.client.hscan_iter(key, count=1000):
        try:
            message, _exchange, routing_key = json.loads(payload)
        except (ValueError, TypeError):
            continue
        if _task_id_of(message) == task_id:
            return str(routing_key)
    return None


def _task_id_of(raw: Any) -> str | None:
    from celery_ojs_ml.store.broker import header_of

    found = header_of(raw, "id")
    return found if isinstance(found, str) else None


def end_grants_of(plugin: Any, worker: str) -> None:
    """End every grant `worker` holds, from outside the leader (RFC 27 prioritize of a job
    sent under one): the leader notices at its next pass, which this wakes, and takes the
    holder's queued jobs back; the holder gives back those held at its gate."""
    book = plugin.grant_book
    book.revoke([f for f, (w, _) in book.all().items() if w == worker])


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
