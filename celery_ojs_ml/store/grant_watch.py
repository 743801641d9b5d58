"""A publisher's copy of the grants hash, kept valid by Redis key tracking.

Routing a job reads which worker holds its class's grant (`store.grants`). Read
with one HGET per publish, that is a round trip on every job's path, and on a loaded
host the largest cost the plugin adds to a publisher. `GrantWatch` reads the whole hash
once and keeps it until Redis says the hash changed.

Key decisions:
* Redis' own invalidation (`CLIENT TRACKING ... BCAST PREFIX <key>`, Redis 6+) on a
  connection of its own: RESP3 pushes on that connection, or RESP2 messages redirected
  to it (`__redis__:invalidate`). Redis sends the invalidation while it executes the
  write, so a lookup that polls the connection first (one non-blocking `poll`, about a
  microsecond) sees every write whose reply the writer already has: the copy answers
  as an HGET sent at that moment would. The race that remains, a grant revoked between
  the lookup and the publish, is the one an HGET has too; the leader's sweep and the
  holder's epoch check cover it (`leader.granting`, `worker.granted`).
* Anything unusual drops the copy: a message that cannot be read, a closed connection,
  a fork (the child opens its own). A server without tracking (fakeredis, Redis < 6, a
  proxy that refuses CLIENT) makes the watch step aside: `lookup` says it does not
  know, and the caller reads the field itself, as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import redis

log = logging.getLogger(__name__)

_RETRY_S = 5.0
"""After a failure, how long lookups read the store before the watch connects again."""
_SOCKET_TIMEOUT_S = 1.0
CLIENT_NAME = "ojs-ml-grant-watch"
"""The watch connection's name in `CLIENT LIST`."""


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


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
