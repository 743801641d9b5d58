"""Assignments and annotations in the pending set: the leader's writes at each pass
(`pending.PendingBook` delegates here).

Key decision: a pass's assignments, with the RFC 27 annotations of the jobs left
waiting, go out as one pipeline of bare `EVALSHA`s of the ASSIGN script (each
`pending` -> `assigned` with a fresh token, and the delivery pushed in the same
call), so a pass costs one round trip however many jobs it places.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import redis

from celery_ojs_ml.store import pending_scripts as scripts
from celery_ojs_ml.store.pending_records import (
    _NO_SCRIPTING,
    ASSIGNED,
    PENDING,
    compare_and_set,
    job_key,
)
from celery_ojs_ml.store.registry import OJSStore

log = logging.getLogger("celery_ojs_ml.store.pending")


class PendingAssigner:
    """`assign`, `assign_many` and `annotate` (see module doc)."""

    def __init__(self, store: OJSStore) -> None:
        self.store = store
        self._r = store.client
        self._changed = store.key("pdirty")
        self._assign_script: Any = self._r.register_script(scripts.ASSIGN)

    def _key(self, task_id: str) -> str:
        return job_key(self.store, task_id)

    def assign(
        self,
        task_id: str,
        worker: str,
        *,
        now: float,
        victims: Iterable[str] = (),
        token: str | None = None,
        push: tuple[str, bytes] | None = None,
    ) -> str | None:
        """`pending` -> `assigned` to `worker` with a fresh token (or `token`); None if not
        pending. `push` (list key, raw message): LPUSHed in the same call when it assigns
        (the leader's delivery, `redis_intake.envelope`)."""
        token = token or uuid.uuid4().hex
        fields = {
            "state": ASSIGNED,
            "worker": worker,
            "token": token,
            "assigned_at": repr(now),
            "victims": json.dumps(list(victims)),
        }
        if self._assign_script is not None:
            keys, args = self._assign_call(task_id, worker, token, fields, push)
            try:
                return token if self._assign_script(keys=keys, args=args) else None
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except _NO_SCRIPTING as exc:
                log.info("ojs-ml: no Lua scripting on the store (%s); assigns use MULTI/WATCH", exc)
                self._assign_script = None
        ok = compare_and_set(self.store, task_id, lambda r: r.get("state") == PENDING, fields)
        if ok and push is not None:
            self._r.lpush(*push)
        return token if ok else None

    def assign_many(
        self,
        items: Sequence[tuple[str, str, str, tuple[str, bytes] | None]],
        now: float,
        notes: Mapping[str, tuple[str, float | None, str | None]] | None = None,
        also: Callable[[Any], None] | None = None,
        before: Callable[[Any], Callable[[Any], None] | None] | None = None,
    ) -> list[str | None]:
        """`assign` of (task id, worker, token, push) each, and `annotate(notes)`, in one
        pipeline where the store runs Lua; each item's token, or None where the job was
        not pending any more. `also` may queue more commands on that pipeline (it is
        not called where there is none); `before` queues commands ahead of them and returns
        what takes their reply (as in `pass_reads`; without Lua it raises, nothing assigned).

        The script goes out as a bare `EVALSHA`: redis-py's pipelined `Script` asks
        `SCRIPT EXISTS` first, a round trip of its own on every pass. Where the server
        does not hold the script (its first use, a restart) those items are assigned
        again one by one, which loads it."""
        script = self._assign_script
        replies = (
            None if script is None else self._assign_pipelined(items, now, notes, also, before)
        )
        if replies is None and before is not None:
            raise RuntimeError("assign_many(before=...) needs Lua on the store")
        if replies is None:  # no Lua (or it failed): one by one, `assign` finds out for good
            self.annotate(notes or {})
            return self._replicated(
                [self.assign(t, w, now=now, token=k, push=p) for t, w, k, p in items]
            )
        replies[: len(items)] = self._unloaded_again(items, replies[: len(items)], now)
        tokens: list[str | None] = []
        for (_, _, token, _), ok in zip(items, replies, strict=False):
            if isinstance(ok, Exception):
                raise ok
            tokens.append(token if ok else None)
        for reply in replies[len(items) :]:
            if isinstance(reply, Exception):
                raise reply
        return self._replicated(tokens)

    def _unloaded_again(
        self,
        items: Sequence[tuple[str, str, str, tuple[str, bytes] | None]],
        replies: list[Any],
        now: float,
    ) -> list[Any]:
        """`replies`, with the items the server had no script for (its first use, a
        restart) assigned again in one more pipeline once the script is loaded: one by
        one, a new leader's first pass of 20,000 assignments made 20,000 round trips."""
        again = [i for i, ok in enumerate(replies) if isinstance(ok, _NO_SCRIPTING)]
        if not again:
            return replies
        try:
            self._r.script_load(scripts.ASSIGN)
            redo = self._assign_pipelined([items[i] for i in again], now, None, None)
        except redis.ResponseError as exc:  # e.g. an ACL without SCRIPT LOAD
            log.info("ojs-ml: could not load the assign script (%s); one at a time", exc)
            redo = None
        for n, i in enumerate(again):
            if redo is None or isinstance(redo[n], _NO_SCRIPTING):
                task_id, worker, token, push = items[i]
                replies[i] = self.assign(task_id, worker, now=now, token=token, push=push)
            else:
                replies[i] = redo[n]
        return replies

    def _replicated(self, tokens: list[str | None]) -> list[str | None]:
        """`tokens`, once the store's replicas hold the assignments (`OJSStore.replicated`):
        a gate must not start an assignment that a failover could undo."""
        if any(tokens):
            self.store.replicated()
        return tokens

    def _assign_pipelined(
        self,
        items: Sequence[tuple[str, str, str, tuple[str, bytes] | None]],
        now: float,
        notes: Mapping[str, tuple[str, float | None, str | None]] | None,
        also: Callable[[Any], None] | None,
        before: Callable[[Any], Callable[[Any], None] | None] | None = None,
    ) -> list[Any] | None:
        """`assign_many`'s pipeline: each item's reply (or error), then the notes'; None
        where the store runs no Lua."""
        fields = {"assigned_at": repr(now), "victims": "[]"}
        sha = self._assign_script.sha
        try:
            with self._r.pipeline(transaction=False) as pipe:
                first = before(pipe) if before is not None else None
                for task_id, worker, token, push in items:
                    keys, args = self._assign_call(task_id, worker, token, fields, push)
                    pipe.evalsha(sha, len(keys), *keys, *args)
                self._annotations(pipe, notes or {})
                if also is not None:
                    also(pipe)
                replies = list(pipe.execute(raise_on_error=False))
                if first is not None:
                    first(replies.pop(0))
                return replies
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except _NO_SCRIPTING as exc:
            log.info("ojs-ml: pipelined assignments failed (%s); one at a time", exc)
            return None

    def _assign_call(
        self,
        task_id: str,
        worker: str,
        token: str,
        fields: Mapping[str, str],
        push: tuple[str, bytes] | None,
    ) -> tuple[list[str], list[str]]:
        """The ASSIGN script's keys and arguments."""
        args = [worker, token, fields["assigned_at"], fields["victims"], task_id]
        keys = [self._key(task_id), self._changed]
        if push is not None:
            keys, args = [*keys, push[0]], [*args, push[1].decode()]
        return keys, args

    def annotate(
        self, notes: Mapping[str, tuple[str, float | None, str | None]], *, ahead: bool = False
    ) -> None:
        """RFC 27 annotate: `{task_id: (reason_pending, t_estimate, worker)}` in one round trip.
        `ahead`: the jobs were delivered ahead of capacity and wait at `worker`'s gate."""
        if not notes:
            return
        with self._r.pipeline(transaction=False) as pipe:
            self._annotations(pipe, notes, ahead)
            pipe.execute()

    def _annotations(
        self,
        pipe: Any,
        notes: Mapping[str, tuple[str, float | None, str | None]],
        ahead: bool = False,
    ) -> None:
        for task_id, (reason, t_est, worker) in notes.items():
            note: dict[str, Any] = {"reason_pending": reason, "t_estimate": t_est, "worker": worker}
            if ahead:
                note["ahead"] = True
            pipe.hset(self._key(task_id), "annotation", json.dumps(note))
