"""Admission into the pending set (`pending.PendingBook` delegates here).

An admission writes the job's record (its message and metadata) and its index
entry; a job is admitted again only once its earlier record was started or is
gone, and never twice for one published message (`ojs_msg`, the record's `seen`).
Only the leader admits (it drains the intake), so `on_admit` tells it of each
record written instead of marking it changed in the store.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import redis

from celery_ojs_ml.lru import LRU
from celery_ojs_ml.store import pending_scripts as scripts
from celery_ojs_ml.store.pending_records import (
    _NO_SCRIPTING,
    HEADER_MSG,
    PENDING,
    STARTED,
    _text,
    job_key,
    transaction,
)
from celery_ojs_ml.store.registry import OJSStore

log = logging.getLogger("celery_ojs_ml.store.pending")
_SEEN = 32
"""Message ids kept per job: more than any job's re-publishes within its tombstone's day."""


def _admit_args(jobs: list[tuple[str, dict[str, Any], dict[str, Any]]], now: str) -> list[Any]:
    """The ADMIT script's arguments (`pending_scripts.ADMIT`)."""
    args: list[Any] = [now, _SEEN]
    for task_id, meta, msg in jobs:
        msg_id = (msg.get("headers") or {}).get(HEADER_MSG)
        score = float(meta.get("submitted_at") or 0.0)
        msg_id = msg_id if isinstance(msg_id, str) else ""
        args += [task_id, json.dumps(msg), json.dumps(meta), msg_id, repr(score)]
    return args


class PendingAdmission:
    """`admit`, `admit_many` and `admit_in` (see module doc).

    `msgs` is the decoded-message cache shared with the reader: an admitted
    message goes in it, so the leader's next pass does not read it back.
    """

    def __init__(
        self,
        store: OJSStore,
        msgs: LRU[tuple[str, str], dict[str, Any]],
        on_admit: Callable[[str, dict[str, Any]], None],
    ) -> None:
        self.store = store
        self._r = store.client
        self._index = store.key("pjobs")
        self._admit_script: Any = self._r.register_script(scripts.ADMIT)
        self._msgs = msgs
        self.on_admit = on_admit

    def _key(self, task_id: str) -> str:
        return job_key(self.store, task_id)

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
        self._admitted(jobs, fresh, now)
        return fresh

    def admit_in(
        self, pipe: Any, jobs: list[tuple[str, dict[str, Any], dict[str, Any]]]
    ) -> Callable[[Any], list[bool]] | None:
        """Queue `admit_many(jobs)` on `pipe` (the leader's pass reads carry it, so the
        reads after it see the jobs); the function returned takes its reply. None where
        the store runs no Lua: admit them with `admit_many` instead.

        Where the server does not hold the script (its first use, a restart) the
        function admits them with `admit_many`, which loads it."""
        if self._admit_script is None or not jobs:
            return None
        keys = [self._key(task_id) for task_id, _, _ in jobs]
        now = repr(self.store._clock())
        args = _admit_args(jobs, now)
        pipe.evalsha(self._admit_script.sha, len(keys) + 1, self._index, *keys, *args)

        def finish(reply: Any) -> list[bool]:
            if isinstance(reply, redis.exceptions.NoScriptError):
                return self.admit_many(jobs)
            if isinstance(reply, Exception):
                raise reply
            fresh = [bool(x) for x in reply]
            self._admitted(jobs, fresh, now)
            return fresh

        return finish

    def _admitted(
        self, jobs: list[tuple[str, dict[str, Any], dict[str, Any]]], fresh: list[bool], now: str
    ) -> None:
        """Tell `on_admit` of each job admitted, once the store's replicas hold them
        (`OJSStore.replicated`): the caller then settles their intake messages."""
        if any(fresh):
            self.store.replicated()
        for (task_id, meta, msg), ok in zip(jobs, fresh, strict=True):
            if ok:  # the leader's next pass needs no read of what it just wrote
                self._msgs[(task_id, now)] = msg
                record = {"state": PENDING, "meta": meta, "admitted_at": now, "msg": msg}
                self.on_admit(task_id, record)

    def _admit_lua(
        self, jobs: list[tuple[str, dict[str, Any], dict[str, Any]]], keys: list[str], now: str
    ) -> list[bool] | None:
        """`admit_many` in one round trip; None where the store runs no Lua."""
        if self._admit_script is None:
            return None
        args = _admit_args(jobs, now)
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

        return list(transaction(self._r, keys, txn))
