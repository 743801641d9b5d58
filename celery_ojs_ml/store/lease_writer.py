"""Batched hot-path lease writes of one worker (DESIGN decision 4).

Key decisions:
* The two writes on every job's hot path, take and release, go through a
  `LeaseWriter`. In a worker with an event loop (prefork) it batches them: a
  lease is written once its job has run for a short delay (`IDLE_DELAY_S`,
  `BUSY_DELAY_S`), together with every queued release, as one Lua call (releases
  token-checked) on a connection of its own, so the write is off the task's start-up
  path and costs one round trip per batch. The broker message is acked only when its
  lease is written; a job that finishes before that needs no lease at all.
* Without an event loop (threads pool, the embedded demo) each write is made at once;
  without scripting (fakeredis without lupa) `LeaseBook` falls back to MULTI.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import redis

from celery_ojs_ml.store import granted_jobs
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.store.resp import pack_command

log = logging.getLogger(__name__)

Batch = tuple[list[tuple[str, str, float]], list[tuple[str, str]], list[Callable[[bool], None]]]


@dataclass(frozen=True, slots=True)
class Fired:
    """Commands sent by `LeaseWriter.fire`: their number of replies, and what redoes them."""

    replies: int
    again: Callable[[], None]


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


class LeaseRecords(Protocol):
    """What a `LeaseWriter` needs of the lease records (`leases.LeaseBook`)."""

    @property
    def store(self) -> OJSStore: ...

    @property
    def batch_sha(self) -> str | None: ...

    def new_lease(
        self, record: dict[str, Any], token: str | None = None
    ) -> tuple[str, tuple[str, str, float]]: ...

    def write_batch(
        self, takes: list[tuple[str, str, float]], releases: list[tuple[str, str]]
    ) -> bool: ...

    def batch_arguments(
        self, takes: list[tuple[str, str, float]], releases: list[tuple[str, str]]
    ) -> tuple[list[str], list[Any]]: ...

    def load_scripts(self) -> None: ...


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
        book: LeaseRecords,
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
        self._forgets: dict[str, list[str]] = {}
        """hash key -> fields to delete with the next batch (`forget`)."""
        self._timer_at: float | None = None
        self._last_take = -1e9
        self._conn: Any = None
        self._fd: int | None = None
        self._inflight: deque[Batch | Fired] = deque()
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
        if self._defer is not None and self._releasing(task_id):
            self.flush(wait=True)  # see `_releasing`
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

    def _releasing(self, task_id: str) -> bool:
        """Whether the release of an earlier run of `task_id` is queued or unanswered.

        A run's checkpoint commits are fenced on the job's lease: absent, or its own
        (`checkpoint.records.commit`). A new run of the same job starting here (a retry
        within the lease delay of the last run's end) would find the last run's lease
        still there until the batch goes out, take that for another worker's, and stop;
        so that release is written, and answered, before the new run starts."""
        if not self._releases and not self._inflight:
            return False  # the usual case: nothing queued, nothing unanswered
        if any(t == task_id for t, _ in self._releases):
            return True
        sent = (batch[1] for batch in self._inflight if not isinstance(batch, Fired))
        return any(t == task_id for releases in sent for t, _ in releases)

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

    def forget(self, key: str, field: str) -> None:
        """Queue `HDEL key field` (a granted job's record: `store.granted_jobs`)."""
        if self._defer is None:
            granted_jobs.forget_many(self.book.store, {key: [field]})
            return
        self._forgets.setdefault(key, []).append(field)
        self._schedule(self._clock() + self._delays[1])

    def _send_forgets(self) -> None:
        forgets, self._forgets = self._forgets, {}

        def sync() -> None:
            granted_jobs.forget_many(self.book.store, forgets)

        if forgets and not self.fire([("HDEL", k, *f) for k, f in forgets.items()], sync):
            sync()

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
        self._send_forgets()
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

    def fire(self, commands: Sequence[Sequence[Any]], again: Callable[[], None]) -> bool:
        """Send `commands` on the writer's connection without waiting for their replies
        (the event loop reads them); `again` redoes them, synchronously, when one fails or
        the connection is lost first. False: nothing sent (no connection of its own)."""
        conn = self._connection()
        if conn is None:
            return False
        try:
            conn.send_packed_command([pack_command(*c) for c in commands])
        except Exception as exc:
            self._lost(exc)
            return False
        self._inflight.append(Fired(len(commands), again))
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
        first = self._inflight[0]
        if isinstance(first, Fired):
            self._inflight.popleft()
            self._settle_fired(first)
            return
        try:
            self._conn.read_response()
        except redis.ResponseError as exc:  # NOSCRIPT after a server restart, or a script error
            batch = cast(Batch, self._inflight.popleft())
            log.info("ojs-ml: a batched lease write failed (%s); writing it again", exc)
            self._finish(batch, self._write(batch[0], batch[1]))
            return
        self._finish(cast(Batch, self._inflight.popleft()), True)

    def _settle_fired(self, fired: Fired) -> None:
        failed = None
        try:
            for _ in range(fired.replies):
                try:
                    self._conn.read_response()
                except redis.ResponseError as exc:
                    failed = exc
        except Exception:
            fired.again()  # the connection broke: `_lost` redoes the rest
            raise
        if failed is not None:
            log.info("ojs-ml: a write sent without waiting failed (%s); writing it again", failed)
            fired.again()

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
            if isinstance(batch, Fired):
                batch.again()
                continue
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
