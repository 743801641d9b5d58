"""Leases of running ML jobs (DESIGN decision 4): Redis records, not unacked messages.

Key decision: the gate writes a job's lease (what a re-publish needs, its worker,
allocation and deadline) before it acks the broker message, so a multi-hour job never
trips a broker's redelivery timeout and a crash loses nothing. Every write carries a
random token; release, refresh and claims only touch a lease whose token is theirs.
Hot-path writes are batched by `lease_writer.LeaseWriter` (re-exported here).

Layout: `<prefix>:{ml}:lease:<task>`                string  lease JSON, no TTL
        `<prefix>:{ml}:leases`                      zset    task id -> deadline
        `<prefix>:{ml}:lease-taken:<task>:<token>`  string  `mark_taken_back`
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import redis

from celery_ojs_ml.store import lease_scripts as scripts
from celery_ojs_ml.store.feed import FED, MAXLEN, append
from celery_ojs_ml.store.lease_scripts import _sort_by_token, _with_deadline
from celery_ojs_ml.store.lease_writer import (
    BUSY_DELAY_S,
    BUSY_WINDOW_S,
    IDLE_DELAY_S,
    Batch,
    LeaseWriter,
    Record,
)
from celery_ojs_ml.store.registry import NO_SCRIPTING, OJSStore
from celery_ojs_ml.store.resp import pack_command
from celery_ojs_ml.wire.records import republish_headers

__all__ = [
    "BUSY_DELAY_S",
    "BUSY_WINDOW_S",
    "IDLE_DELAY_S",
    "Batch",
    "LeaseBook",
    "LeaseWriter",
    "Record",
    "pack_command",
    "republish_headers",
]

log = logging.getLogger(__name__)
_RETRIES = 16
TAKEN_BACK_TTL_S = 7 * 24 * 3600
"""How long a claimer's mark that a copy was re-published stays (`mark_taken_back`): longer
than any worker could stall and come back with its copy still running."""
_NO_SCRIPTING = NO_SCRIPTING


class LeaseBook:
    """Lease records of one store; every method is safe to call from any worker.

    A lease is a plain key without TTL plus a sorted-set index by deadline, so an
    expired lease is still readable by whoever claims it. A claim is a WATCH/MULTI
    compare-and-set on the lease (no Lua, so fakeredis works), which makes exactly one
    claimer win. Because release and refresh check the token, a late release by a dead
    incarnation (or by the claimer, after the re-published job already started
    elsewhere and wrote its own lease) never deletes someone else's lease, and a
    heartbeat racing a claim never writes the old token back. Refresh checks and writes
    in one Lua call that splices the new deadline into the stored JSON instead of
    decoding and re-encoding it (Lua's cjson would turn `[]` into `{}` and round
    floats), which is why `deadline` is always a lease's last field; without scripting
    it is a WATCH/MULTI transaction over the owner's leases.
    """

    def __init__(self, store: OJSStore, ttl_s: float) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._r = store.client
        self._index = store.key("leases")
        self.feed = store.key("feed", "lease")
        """Leases written or claimed, not refreshed (`store.feed`)."""
        self._scripts: dict[str, Any] | None = {
            "release": self._r.register_script(scripts.RELEASE),
            "batch": self._r.register_script(scripts.BATCH),
            "refresh": self._r.register_script(scripts.REFRESH),
        }

    def _script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run a hot-path script; None when the server cannot (then use the fallback)."""
        if self._scripts is None:
            return None
        try:
            return self._scripts[name](keys=keys, args=args)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except _NO_SCRIPTING as exc:
            log.info("ojs-ml: no Lua scripting on the store (%s); leases use MULTI/WATCH", exc)
            self._scripts = None
            return None

    def _key(self, task_id: str) -> str:
        return self.store.lease_key(task_id)

    def _now(self) -> float:
        return float(self.store._clock())

    def new_lease(
        self, record: dict[str, Any], token: str | None = None
    ) -> tuple[str, tuple[str, str, float]]:
        """The token (fresh unless given) and `(task_id, json, deadline)` take of a job.

        Raises TypeError/ValueError when the record is not JSON.
        """
        token = token or uuid.uuid4().hex
        deadline = self._now() + self.ttl_s
        payload = json.dumps(_with_deadline({**record, "token": token, FED: 1}, deadline))
        return token, (record["task_id"], payload, deadline)

    def take(self, record: dict[str, Any], token: str | None = None) -> str:
        """Write (or overwrite) the lease of a job starting now; returns its token.

        `token` keeps a lease's existing token (a lease written again after it vanished).
        """
        token, lease = self.new_lease(record, token)
        self.write_batch([lease], [])
        return token

    def mark_taken_back(self, task_id: str, token: str | None) -> None:
        """Remember that the copy holding lease `token` was re-published (or dead-lettered)
        by a claimer, for `TAKEN_BACK_TTL_S`: the claimer then deletes the lease, and a
        worker that stalled past the TTL would else find it missing, write it again and
        run its copy beside the new one (`was_taken_back`)."""
        if token:
            self._r.set(self._taken_key(task_id, token), 1, ex=TAKEN_BACK_TTL_S)

    def was_taken_back(self, task_id: str, token: str) -> bool:
        """Whether the copy with lease `token` was re-published by a claimer."""
        return bool(self._r.exists(self._taken_key(task_id, token)))

    def _taken_key(self, task_id: str, token: str) -> str:
        return taken_back_key(self.store, task_id, token)

    def get(self, task_id: str) -> dict[str, Any] | None:
        """The lease of a job, or None."""
        raw = self._r.get(self._key(task_id))
        return json.loads(raw) if raw else None

    def index_read(self) -> tuple[str, str]:
        """`(index, key prefix)` of the `OJSStore.indexed` read behind `all()`."""
        return self._index, self._key("")

    def all(self) -> list[dict[str, Any]]:
        """Every lease (running, expired or being claimed)."""
        found = self.store.indexed(self._index, self._key(""))
        if found is not None:
            return [json.loads(value) for _, value in found]
        members: list[Any] = self._r.zrange(self._index, 0, -1)
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in members]
        if not ids:
            return []
        values = self._r.mget([self._key(i) for i in ids])
        return [json.loads(v) for v in values if v]

    def refresh(self, tokens: dict[str, str]) -> tuple[list[str], list[str]]:
        """Push the deadlines of our leases: a compare-and-set on each lease's token.

        Returns `(taken_over, missing)`: the task ids whose lease now carries
        another token (a claimer took the job over) and those with no lease at
        all (lost with the store, or released by the copy that took over). Only
        a lease whose stored token is ours is extended, in the same atomic step
        that checks it, so a claim is never undone.
        """
        if not tokens:
            return [], []
        deadline = self._now() + self.ttl_s
        ids = list(tokens)
        keys = [self._index, *(self._key(i) for i in ids)]
        args: list[Any] = [json.dumps(deadline)]
        for task_id in ids:
            args += [task_id, tokens[task_id]]
        seen = self._script("refresh", keys, args)
        if seen is None:
            return self._refresh_watched(tokens, deadline)
        codes = seen.decode() if isinstance(seen, bytes) else str(seen)
        by_code: dict[str, list[str]] = {"k": [], "t": [], "m": [], "r": []}
        for task_id, code in zip(ids, codes, strict=True):
            by_code[code].append(task_id)
        if not by_code["r"]:
            return by_code["t"], by_code["m"]
        taken, missing = self._refresh_watched({i: tokens[i] for i in by_code["r"]}, deadline)
        return by_code["t"] + taken, by_code["m"] + missing

    def _refresh_watched(
        self, tokens: dict[str, str], deadline: float
    ) -> tuple[list[str], list[str]]:
        """`refresh` without scripting: a WATCH/MULTI transaction, again if a lease changed."""
        ids = list(tokens)
        keys = [self._key(i) for i in ids]
        for _ in range(_RETRIES):
            with self._r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(*keys)  # type: ignore[no-untyped-call]
                    taken, missing, ours = _sort_by_token(ids, pipe.mget(keys), tokens)
                    pipe.multi()
                    for task_id, lease in ours:
                        pipe.set(self._key(task_id), json.dumps(_with_deadline(lease, deadline)))
                        pipe.zadd(self._index, {task_id: deadline})
                    pipe.execute()
                    return taken, missing
                except redis.WatchError:
                    continue
        log.warning("ojs-ml: %d lease(s) are contended; not refreshed this round", len(ids))
        return [], []

    def release(self, task_id: str, token: str) -> bool:
        """Delete a lease if it is still the one with `token`."""
        keys = [self._key(task_id), self._index, self.feed]
        done = self._script("release", keys, [task_id, token, MAXLEN])
        if done is not None:
            return bool(done)
        return self._cas(task_id, lambda lease: lease.get("token") == token, None) is not None

    @property
    def batch_sha(self) -> str | None:
        """SHA1 of the batch script; None where the store has no scripting."""
        return None if self._scripts is None else str(self._scripts["batch"].sha)

    def load_scripts(self) -> None:
        """Load the batch script now, so that a bare EVALSHA finds it."""
        if self._scripts is not None:
            self._r.script_load(scripts.BATCH)

    def batch_arguments(
        self, takes: list[tuple[str, str, float]], releases: list[tuple[str, str]]
    ) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of the batch script."""
        keys = [self._index, self.feed]
        args: list[Any] = [len(takes)]
        for task_id, payload, deadline in takes:
            keys.append(self._key(task_id))
            args += [task_id, payload, deadline]
        for task_id, token in releases:
            keys.append(self._key(task_id))
            args += [task_id, token]
        return keys, [*args, MAXLEN]

    def write_batch(
        self, takes: list[tuple[str, str, float]], releases: list[tuple[str, str]]
    ) -> bool:
        """Write leases `(task_id, json, deadline)` and release `(task_id, token)` at once.

        One Lua call (one round trip, one reply to parse), atomic like a
        MULTI/EXEC. Returns whether the takes were written; raises when the
        store is unreachable (the caller keeps the messages unacked).
        """
        keys, args = self.batch_arguments(takes, releases)
        if self._script("batch", keys, args) is not None:
            return True
        return self._write_one_by_one(takes, releases)

    def _release_again(self, task_id: str, token: str, error: Exception) -> None:
        """A batched release failed (NOSCRIPT after a server restart, or no Lua): retry it."""
        try:
            self.release(task_id, token)
        except Exception as exc:
            log.warning("ojs-ml: could not release the lease of %s: %s (%s)", task_id, exc, error)

    def _write_one_by_one(
        self, takes: list[tuple[str, str, float]], releases: list[tuple[str, str]]
    ) -> bool:
        with self._r.pipeline(transaction=True) as pipe:
            for task_id, payload, deadline in takes:
                pipe.set(self._key(task_id), payload)
                pipe.zadd(self._index, {task_id: deadline})
                pipe.execute_command(*append(self.feed, task_id))  # type: ignore[no-untyped-call]
            if takes:
                pipe.execute()
        for task_id, token in releases:
            self._release_again(task_id, token, RuntimeError("no scripting"))
        return True

    def expired(self) -> list[str]:
        """Task ids whose lease deadline has passed."""
        raw: list[Any] = self._r.zrangebyscore(self._index, "-inf", self._now())
        return [i.decode() if isinstance(i, bytes) else str(i) for i in raw]

    def claim(
        self, task_id: str, claimer: str, incarnation: str, *, stale_owner: str | None = None
    ) -> dict[str, Any] | None:
        """Atomically take over an expired lease (or a stale one of `stale_owner`).

        Returns the lease as it was (the job to re-publish) with the claimer's
        new token in `claim_token`, or None when someone else won or it is live.
        """
        now = self._now()

        def claimable(lease: dict[str, Any]) -> bool:
            if stale_owner is not None:
                return bool(
                    lease.get("worker") == stale_owner and lease.get("incarnation") != incarnation
                )
            return float(lease.get("deadline", 0)) < now

        token = uuid.uuid4().hex
        before = self._cas(
            task_id,
            claimable,
            lambda lease: _with_deadline(
                {
                    **lease,
                    "worker": claimer,
                    "incarnation": incarnation,
                    "token": token,
                    "claimed_from": lease.get("worker"),
                    FED: 1,
                },
                now + self.ttl_s,
            ),
        )
        return None if before is None else {**before, "claim_token": token}

    def stale_of(self, worker: str, incarnation: str) -> list[str]:
        """Leases a previous incarnation of `worker` left behind (Flux `sched-hello`)."""
        return [
            lease["task_id"]
            for lease in self.all()
            if lease.get("worker") == worker and lease.get("incarnation") != incarnation
        ]

    def _cas(self, task_id: str, test: Any, update: Any) -> dict[str, Any] | None:
        """If `test(lease)`, replace it by `update(lease)` (or delete when None); else None."""
        key = self._key(task_id)
        for _ in range(_RETRIES):
            with self._r.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]
                    raw = pipe.get(key)
                    lease = json.loads(raw) if raw else None
                    if lease is None or not test(lease):
                        pipe.unwatch()
                        if lease is None and self._r.zrem(self._index, task_id):
                            self._r.execute_command(*append(self.feed, task_id))  # type: ignore[no-untyped-call]
                        return None
                    pipe.multi()
                    new = update(lease) if update is not None else None
                    if new is None:
                        pipe.delete(key)
                        pipe.zrem(self._index, task_id)
                        pipe.execute_command(*append(self.feed, task_id))  # type: ignore[no-untyped-call]
                    else:
                        pipe.set(key, json.dumps(new))
                        pipe.zadd(self._index, {task_id: new["deadline"]})
                        pipe.execute_command(*append(self.feed, task_id))  # type: ignore[no-untyped-call]
                    pipe.execute()
                    return dict(lease)
                except redis.WatchError:
                    continue
        log.warning("ojs-ml: lease %s is contended; giving up this round", task_id)
        return None


def taken_back_key(store: OJSStore, task_id: str, token: str) -> str:
    """The key of `mark_taken_back`: a checkpoint commit of that copy is refused by it."""
    return store.key("lease-taken", task_id, token)
