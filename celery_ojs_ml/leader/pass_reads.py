"""The reads every leader pass starts with, in one round trip.

Key decision: the pending set's index and change marks, whether any
reservation exists, the live workers, the leases and the start times of the
jobs the ledger holds are independent reads; they go out as one pipeline.
The change marks are popped with `SPOP`: every record is read after the pop,
so a change made after it is marked again and read next pass. Where the store
runs no Lua (fakeredis) `read_pass` returns None and the pass reads one by
one; where the server does not hold the script (its first use, a restart) the
workers and leases are read again one by one, which loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from celery_ojs_ml.store.feed import FeedReader, heartbeat, lease
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore, _text

_POP_ALL = 1 << 30
"""`SPOP` count: every change mark there is."""


@dataclass
class PassReads:
    """What a pass starts from (see module doc)."""

    index: list[str]
    """The pending set's index: waiting and assigned jobs in admission order."""
    changed: set[str]
    """Jobs whose record changed since the last pass (`PendingView`)."""
    reserving: bool
    """Whether any reservation record exists."""
    workers: dict[str, dict[str, Any]]
    """`OJSStore.live_workers()`, through the leader's `FeedReader`: only the
    heartbeats that changed since the last pass are read."""
    leases: list[dict[str, Any]]
    """`LeaseBook.all()`."""
    started: dict[str, float | None]
    """`PendingBook.started_at(assigned)`."""


def read_pass(
    store: OJSStore,
    book: PendingBook,
    reservations_key: str,
    assigned: list[str],
    feeds: Feeds,
    before: Callable[[Any], Callable[[Any], None] | None] | None = None,
) -> PassReads | None:
    """The pass's first reads in one pipeline, with the start times of the jobs in
    `assigned`; None where the store runs no Lua. `before` may queue a command ahead
    of the reads (the intake's admission) and return what takes its reply."""
    sha = store.indexed_sha
    if sha is None:
        return None
    cutoff = store.live_read("worker")[2]
    workers = feeds.workers
    with store.client.pipeline(transaction=False) as pipe:
        first = before(pipe) if before is not None else None
        pipe.zrange(book.index_key, 0, -1)
        pipe.spop(book.changed_key, _POP_ALL)
        pipe.exists(reservations_key)
        feeds.queue(pipe, cutoff)
        book.read_started(pipe, assigned)
        replies = pipe.execute(raise_on_error=False)
    if first is not None:
        first(replies.pop(0))
    ids, changed, exists, live, found, *starts = replies
    for reply in (ids, changed, exists, *starts):
        if isinstance(reply, Exception):
            raise reply
    return PassReads(
        _texts(ids),
        {_text(i) for i in changed or ()},
        bool(exists),
        _script(live, lambda: workers.read(cutoff), workers.apply),
        _script(found, feeds.all_leases, feeds.apply_leases),
        book.parse_started(assigned, starts),
    )


@dataclass
class Feeds:
    """The leader's readers of heartbeats and leases (`store.feed`): each pass reads
    again only the values that changed since the last."""

    workers: FeedReader
    leases: FeedReader

    def queue(self, pipe: Any, cutoff_ms: int) -> None:
        """Both reads into `pipe` (heartbeats past `cutoff_ms` are pruned first)."""
        for reader, cutoff in ((self.workers, cutoff_ms), (self.leases, None)):
            keys, args = reader.arguments(cutoff)
            pipe.evalsha(reader.sha, len(keys), *keys, *args)

    def all_leases(self) -> list[dict[str, Any]]:
        """Every lease, as `LeaseBook.all()` (one round trip; loads the script)."""
        return list(self.leases.read().values())

    def apply_leases(self, reply: list[Any]) -> list[dict[str, Any]]:
        """Every lease after the lease reader's reply."""
        return list(self.leases.apply(reply).values())

    def reset(self) -> None:
        """Read every value at the next pass (a new leadership)."""
        self.workers.reset()
        self.leases.reset()


def feeds_of(store: OJSStore, leases: LeaseBook) -> Feeds:
    """`read_pass`'s readers of `store`'s heartbeats and of `leases`."""
    index, prefix, _ = store.live_read("worker")
    lease_index, lease_prefix = leases.index_read()
    return Feeds(
        FeedReader(store.client, (index, store.worker_feed, prefix), heartbeat),
        FeedReader(
            store.client, (lease_index, leases.feed, lease_prefix), lease, changes_only=True
        ),
    )


def _texts(items: list[Any]) -> list[str]:
    """`_text` of every item; the whole index of the pending set on every pass, so in C
    where every item is bytes (as redis-py returns them)."""
    try:
        return list(map(bytes.decode, items))
    except TypeError:
        return [_text(i) for i in items]


def _script(reply: Any, again: Callable[[], Any], parse: Callable[[Any], Any]) -> Any:
    """A script's reply parsed, or read again by `again` when the server did not hold
    the script (that read loads it)."""
    if isinstance(reply, redis.exceptions.NoScriptError):
        return again()
    if isinstance(reply, Exception):
        raise reply
    return parse(reply)
