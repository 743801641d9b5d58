"""Reading the pending set (`pending.PendingBook` delegates here).

Records are read by id (`get`, `read`) or in admission order (`records`); a read
drops the index entries of jobs that neither wait nor are assigned any more.

Key decision: the leader reads every record on every pass, so a lean read takes
only the fields it uses and skips the message (the largest field, unchanged
while its admission stands) when its decoded copy is in the shared message cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from celery_ojs_ml.lru import LRU
from celery_ojs_ml.store import pending_scripts as scripts
from celery_ojs_ml.store.pending_records import (
    _NO_SCRIPTING,
    ASSIGNED,
    PENDING,
    STARTED,
    _decode,
    _text,
    job_key,
)
from celery_ojs_ml.store.registry import OJSStore

_LEAN = ("state", "meta", "admitted_at", "worker", "token", "assigned_at", "hold_until",
         "returned_at", "priority", "reason", "victims")  # fmt: skip
"""The fields of a record the leader reads on every pass (`records(lean=True)`)."""
_CACHED = b"\x00cached"
"""Stands for a message `_lean` did not read because the cache holds it."""


class PendingReader:
    """`get`, `started_at`, `records`, `index_and_changes`, `read` (see module doc).

    `msgs` is the decoded-message cache it shares with admission, keyed by
    (task id, admitted at).
    """

    def __init__(self, store: OJSStore, msgs: LRU[tuple[str, str], dict[str, Any]]) -> None:
        self.store = store
        self._r = store.client
        self._index = store.key("pjobs")
        self._changed = store.key("pdirty")
        self._prune_script: Any = self._r.register_script(scripts.PRUNE)
        self._msgs = msgs

    def _key(self, task_id: str) -> str:
        return job_key(self.store, task_id)

    def get(self, task_id: str) -> dict[str, Any] | None:
        """The record of one job (any state), or None."""
        raw = self._r.hgetall(self._key(task_id))
        return _decode(raw) if raw else None

    def started_at(self, task_ids: list[str]) -> dict[str, float | None]:
        """When each job's gate started it; None when it is not started or has no record."""
        with self._r.pipeline(transaction=False) as pipe:
            self.read_started(pipe, task_ids)
            return self.parse_started(task_ids, pipe.execute())

    def read_started(self, pipe: Any, task_ids: list[str]) -> None:
        """`started_at`'s reads, queued on `pipe` (the leader's pass reads carry them)."""
        for task_id in task_ids:
            pipe.hmget(self._key(task_id), "state", "started_at")

    @staticmethod
    def parse_started(task_ids: list[str], rows: list[Any]) -> dict[str, float | None]:
        """`started_at` from the replies of `read_started`."""
        out: dict[str, float | None] = {}
        for task_id, (state, at) in zip(task_ids, rows, strict=True):
            ok = state is not None and _text(state) == STARTED and at is not None
            out[task_id] = float(_text(at)) if ok else None
        return out

    def records(self, *, lean: bool = False) -> dict[str, dict[str, Any]]:
        """Every waiting or assigned job: `{task_id: record}`, in admission order.

        `lean` (the leader, every pass): only the fields it reads (`_LEAN`), and the
        message of an admission whose message it already holds is not read again.
        """
        ids = [_text(i) for i in self._r.zrange(self._index, 0, -1)]
        found = self.read(ids, lean=lean)
        return {task_id: found[task_id] for task_id in ids if task_id in found}

    def index_and_changes(self) -> tuple[list[str], set[str]]:
        """The index (admission order) and the ids marked changed since the last call, taken
        in one transaction: a change made after it is marked again for the next call."""
        with self._r.pipeline(transaction=True) as pipe:
            pipe.zrange(self._index, 0, -1)
            pipe.smembers(self._changed)
            pipe.delete(self._changed)
            ids, changed, _ = pipe.execute()
        return [_text(i) for i in ids], {_text(i) for i in changed}

    def read(self, ids: list[str], *, lean: bool = True) -> dict[str, dict[str, Any]]:
        """The waiting or assigned records of `ids`; the others leave the index."""
        if not ids:
            return {}
        raws = self._lean(ids) if lean else self._full(ids)
        found: dict[str, dict[str, Any]] = {}
        gone: list[str] = []
        for task_id, raw in zip(ids, raws, strict=True):
            record = self._decode_cached(task_id, raw) if raw else None
            if (
                record is None
                or record.get("state") not in (PENDING, ASSIGNED)
                or "msg" not in record
            ):
                gone.append(task_id)
            else:
                found[task_id] = record
        if gone:
            self._prune(gone)
        return found

    def _prune(self, gone: list[str]) -> None:
        """Drop index entries whose job neither waits nor is assigned *now* (a job put back
        since it was read, `give_back` with `msg`, keeps its entry)."""
        if self._prune_script is not None:
            try:
                self._prune_script(keys=[self._index, *map(self._key, gone)], args=gone)
                return
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except _NO_SCRIPTING:
                self._prune_script = None
        self._r.zrem(self._index, *gone)

    def _full(self, ids: list[str]) -> list[Any]:
        with self._r.pipeline(transaction=False) as pipe:
            for task_id in ids:
                pipe.hgetall(self._key(task_id))
            return list(pipe.execute())

    def _lean(self, ids: list[str]) -> list[Any]:
        """Raw records of `_LEAN` fields, plus `msg` where the cache does not hold it."""
        with self._r.pipeline(transaction=False) as pipe:
            for task_id in ids:
                pipe.hmget(self._key(task_id), *_LEAN)
            rows = pipe.execute()
        raws = [{k: v for k, v in zip(_LEAN, row, strict=True) if v is not None} for row in rows]
        stamps = [(ids[i], _text(raw.get("admitted_at", ""))) for i, raw in enumerate(raws)]
        missing = [i for i, raw in enumerate(raws) if raw and stamps[i] not in self._msgs]
        if missing:
            with self._r.pipeline(transaction=False) as pipe:
                for i in missing:
                    pipe.hget(self._key(ids[i]), "msg")
                for i, msg in zip(missing, pipe.execute(), strict=True):
                    if msg is not None:
                        raws[i]["msg"] = msg
        for i, raw in enumerate(raws):
            if raw and "msg" not in raw and stamps[i] in self._msgs:
                raw["msg"] = _CACHED
        return raws

    def _decode_cached(self, task_id: str, raw: Mapping[Any, Any]) -> dict[str, Any]:
        """`_decode`, reusing the decoded message of an admission already seen (the leader
        reads every record on every pass; the message, the largest field, never changes
        while its admission stands). The cached message is shared: read it, do not modify."""
        fields = {_text(k): v for k, v in raw.items()}
        key = (task_id, _text(fields.get("admitted_at", "")))
        msg = self._msgs.get(key) if "msg" in fields else None
        if msg is None and fields.get("msg") is _CACHED:  # evicted since `_lean`: read it again
            fields["msg"] = self._r.hget(self._key(task_id), "msg") or b"{}"
        if msg is None:
            record = _decode(fields)
            if isinstance(record.get("msg"), dict):
                self._msgs[key] = record["msg"]
            return record
        record = _decode({k: v for k, v in fields.items() if k != "msg"})
        record["msg"] = msg
        return record
