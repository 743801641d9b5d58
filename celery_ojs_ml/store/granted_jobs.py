"""Jobs sent under a grant and not yet taken up by their holder: one durable record each.

A job published under a grant goes straight to its holder's queue, with no pending
record. kombu's Redis transport takes it off that queue before it records it as
unacked, so a holder killed in between would leave it nowhere. The publisher records
it here before it publishes; the holder's gate forgets it once the message is in its
hands (batched with its lease writes); the leader admits what a departed holder left
here. Admission is idempotent per published message (`ojs_msg`), so a copy also
restored from the holder's lists or kombu's unacked hash is admitted once.

Layout: `ojs:{ml}:granted:<worker>`  hash  task id -> JSON {msg, at}
        `ojs:{ml}:granted-holders`    set   workers with a hash (the leader's index)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import redis

from celery_ojs_ml.store.registry import OJSStore

log = logging.getLogger(__name__)

KEEP_S = 43_200.0
"""How long a record is kept: half the day that admission remembers a message id, so a
record never outlives the dedup that makes its admission safe."""


def key(store: OJSStore, worker: str) -> str:
    """The hash of the jobs sent under a grant to `worker`."""
    return store.key("granted", worker)


def record(store: OJSStore, worker: str, task_id: str, msg: dict[str, Any]) -> None:
    """Record a job about to be published to `worker` under a grant (one round trip)."""
    with store.client.pipeline(transaction=False) as pipe:
        record_in(pipe, store, worker, task_id, msg)
        pipe.execute()


def record_in(pipe: Any, store: OJSStore, worker: str, task_id: str, msg: dict[str, Any]) -> None:
    """Queue `record`'s commands on `pipe` (the publish's own round trip, where the broker
    is the store's Redis: `celery_internals.put_first`)."""
    name = key(store, worker)
    pipe.hset(name, task_id, json.dumps({"msg": msg, "at": store._clock()}))
    pipe.expire(name, int(KEEP_S))
    pipe.sadd(store.key("granted-holders"), worker)


def holders(store: OJSStore) -> set[str]:
    """Every worker that may have records (`record` adds it; `drop_holder` removes it)."""
    raw: set[Any] = store.client.smembers(store.key("granted-holders"))
    return {w.decode() if isinstance(w, bytes) else str(w) for w in raw}


def drop_holder(store: OJSStore, worker: str) -> bool:
    """Remove `worker` from `holders` if it has no record left, atomically (a record
    written meanwhile keeps it); True when removed."""
    name = key(store, worker)
    with store.client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(name)  # type: ignore[no-untyped-call]
            if pipe.hlen(name):
                return False
            pipe.multi()
            pipe.srem(store.key("granted-holders"), worker)
            pipe.execute()
        except redis.WatchError:
            return False
    return True


def forget_in(pipe: Any, store: OJSStore, worker: str, task_ids: Iterable[str]) -> None:
    """Queue the deletion of the records of `task_ids` (taken up by `worker`) on `pipe`."""
    ids = list(task_ids)
    if ids:
        pipe.hdel(key(store, worker), *ids)


def forget(store: OJSStore, worker: str, task_ids: Iterable[str]) -> None:
    """Delete the records of `task_ids` now."""
    ids = list(task_ids)
    if ids:
        store.client.hdel(key(store, worker), *ids)


def forget_many(store: OJSStore, forgets: dict[str, list[str]]) -> None:
    """Delete records of several workers now (`hash key -> task ids`); never raises: a
    record left behind is admitted once, at most (module doc)."""
    try:
        with store.client.pipeline(transaction=False) as pipe:
            for name, fields in forgets.items():
                pipe.hdel(name, *fields)
            pipe.execute()
    except Exception as exc:
        log.warning("ojs-ml: could not forget %d granted records: %s", len(forgets), exc)


def left_by(store: OJSStore, worker: str) -> list[tuple[str, dict[str, Any]]]:
    """The (task id, stored message) of the jobs `worker` never took up, oldest first;
    records older than `KEEP_S` are dropped, not returned."""
    raw: dict[Any, Any] = store.client.hgetall(key(store, worker))
    now, found, stale = store._clock(), [], []
    for field, value in raw.items():
        task_id = field.decode() if isinstance(field, bytes) else str(field)
        try:
            entry = json.loads(value)
            msg, at = dict(entry["msg"]), float(entry["at"])
        except (ValueError, TypeError, KeyError):
            stale.append(task_id)
            continue
        if now - at > KEEP_S:
            stale.append(task_id)
            continue
        found.append((at, task_id, msg))
    if stale:
        log.warning("ojs-ml: dropping %d stale granted records of %s", len(stale), worker)
        forget(store, worker, stale)
    return [(task_id, msg) for _, task_id, msg in sorted(found)]
