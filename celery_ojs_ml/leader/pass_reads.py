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

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore, _text, pairs

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
    """`OJSStore.live_workers()`."""
    leases: list[dict[str, Any]]
    """`LeaseBook.all()`."""
    started: dict[str, float | None]
    """`PendingBook.started_at(assigned)`."""


def read_pass(
    store: OJSStore,
    book: PendingBook,
    leases: LeaseBook,
    reservations_key: str,
    assigned: list[str],
    before: Callable[[Any], Callable[[Any], None] | None] | None = None,
) -> PassReads | None:
    """The pass's first reads in one pipeline, with the start times of the jobs in
    `assigned`; None where the store runs no Lua. `before` may queue a command ahead
    of the reads (the intake's admission) and return what takes its reply."""
    sha = store.indexed_sha
    if sha is None:
        return None
    index, prefix, cutoff = store.live_read("worker")
    lease_index, lease_prefix = leases.index_read()
    with store.client.pipeline(transaction=False) as pipe:
        first = before(pipe) if before is not None else None
        pipe.zrange(book.index_key, 0, -1)
        pipe.spop(book.changed_key, _POP_ALL)
        pipe.exists(reservations_key)
        pipe.evalsha(sha, 1, index, cutoff, prefix)
        pipe.evalsha(sha, 1, lease_index, "", lease_prefix)
        book.read_started(pipe, assigned)
        replies = pipe.execute(raise_on_error=False)
    if first is not None:
        first(replies.pop(0))
    ids, changed, exists, workers, found, *starts = replies
    for reply in (ids, changed, exists, *starts):
        if isinstance(reply, Exception):
            raise reply
    return PassReads(
        _texts(ids),
        {_text(i) for i in changed or ()},
        bool(exists),
        _script(workers, store.live_workers, lambda f: {n: json.loads(v) for n, v in pairs(f)}),
        _script(found, leases.all, lambda f: [json.loads(v) for _, v in pairs(f)]),
        book.parse_started(assigned, starts),
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
