"""The pending set's record layout, shared by its collaborators (`pending.PendingBook`).

Key decision: one hash per job, so every state change is one WATCH/MULTI transaction
on one key (`transaction`; no Lua needed, so fakeredis in the embedded demo works; the
hot paths have Lua twins in `pending_scripts`).

Layout (prefix `ojs`):
    ojs:{ml}:pjob:<task id>     hash  state, msg, meta, worker, token, assigned_at, ...
    ojs:{ml}:pjobs              zset  task id -> admitted at (waiting or assigned jobs)
    ojs:{ml}:pdirty             set   task ids another client changed since the leader's
                                      last pass (`PendingView` reads only those again)
    ojs:{ml}:scheduler:leader   string  JSON {id, since} (`leader_lock`)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import redis

from celery_ojs_ml.store.registry import NO_SCRIPTING, OJSStore
from celery_ojs_ml.wire import headers as h

PENDING, ASSIGNED, STARTED, CANCELLED = "pending", "assigned", "started", "cancelled"
HEADER_MSG = h.MSG
"""A unique id the publisher stamps on each publish of an ML job (`admit_many`)."""
TOMBSTONE_S = 86400
"""How long a started or cancelled record stays, so a late duplicate is recognised."""
_NO_SCRIPTING = NO_SCRIPTING
_RETRIES = 16
_JSON_FIELDS = ("msg", "meta", "annotation", "victims", "seen")


def job_key(store: OJSStore, task_id: str) -> str:
    """The record of one job."""
    return store.key("pjob", task_id)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _decode(raw: Mapping[Any, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {}
    for key, value in raw.items():
        name = _text(key)
        text = _text(value)
        record[name] = json.loads(text) if name in _JSON_FIELDS else text
    return record


def transaction(client: Any, key: str | list[str], body: Callable[[Any], Any]) -> Any:
    """Run `body(pipe)` under WATCH `key`(s); retried when another client changed one."""
    keys = [key] if isinstance(key, str) else key
    for _ in range(_RETRIES):
        with client.pipeline(transaction=True) as pipeline:
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


def compare_and_set(
    store: OJSStore,
    task_id: str,
    test: Callable[[dict[str, Any]], bool],
    fields: dict[str, str],
    drop: tuple[str, ...] = (),
) -> bool:
    """If `test(record)`, set `fields` (and drop `drop`) and mark the job changed."""
    key = job_key(store, task_id)

    def txn(pipe: Any) -> bool:
        raw = pipe.hgetall(key)
        if not raw or not test(_decode(raw)):
            return False
        pipe.multi()
        pipe.hset(key, mapping=fields)
        if drop:
            pipe.hdel(key, *drop)
        pipe.sadd(store.key("pdirty"), task_id)
        return True

    return bool(transaction(store.client, key, txn))
