"""Grants in the store: who holds which class (`scheduler.grants` says when to grant).

One hash, `<prefix>:{ml}:grants`: field `grant_key(queue, band, class)` -> `worker TAB
epoch`. The leader writes it (`GrantBook.issue`, `GrantBook.revoke`); a publisher reads
one field per job it routes (`lookup`); a worker reads its own grants at each
heartbeat and whenever a job arrives under an epoch it does not know (`mine`).

Key decisions:
* The epoch is new for every grant. A job published under a grant carries it (header
  `ojs_grant`); the holder's gate runs it only while the epoch is still its own grant,
  and gives it back to the intake otherwise, so a revoked grant never runs a job out
  of fleet order for longer than the gate takes to notice (one heartbeat at most).
* Revoking takes the jobs still queued on the holder back into the intake in one Lua
  call (`redis_intake.sweep_granted`), before the holder can take them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from celery_ojs_ml.store.grant_watch import GrantWatch
from celery_ojs_ml.store.registry import OJSStore

HEADER_GRANT = "ojs_grant"
"""The epoch of the grant a job was published under (absent: admitted as usual)."""
HEADER_GRANT_AT = "ojs_grant_at"
"""When a job was published under a grant (seconds since the epoch): the leader takes a
holder's queued jobs back once the oldest has waited `ojs_ml_grant_wait_s`."""


def _split(raw: Any) -> tuple[str, str] | None:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    worker, sep, epoch = text.partition("\t")
    return (worker, epoch) if sep and worker and epoch else None


def grants_usable(app: Any) -> bool:
    """Whether this app's publishers and leader use grants: `ojs_ml_grants` on, no
    fair-share weights (fair order is not the leader's first-come placement), and a Redis
    broker that is also the store (the leader takes queued jobs back off the broker's
    lists, `redis_intake.sweep_granted`)."""
    from celery_ojs_ml.store.broker import wake_list
    from celery_ojs_ml.wire.queues import intake_name

    settings = app.ojs_ml.settings
    if not settings.grants or settings.fair_share:
        return False
    return wake_list(app, intake_name(settings.store_prefix)) is not None


def queue_grantable(settings: Any, logical: str) -> bool:
    """Whether jobs of `logical` may be granted: its queue policy sets no budget."""
    policy = settings.queue_policies.get(logical)
    if policy is None:
        return True
    limits = policy.ml_limits
    return limits.max_total_gpus is None and limits.max_concurrent_gpu_jobs is None


class GrantBook:
    """The grants hash of one store."""

    def __init__(self, store: OJSStore) -> None:
        self.store = store
        self.key = store.key("grants")
        self._watch: GrantWatch | None = None

    def lookup(self, field: str) -> tuple[str, str] | None:
        """(worker, epoch) of the grant for `field`, or None: from a copy of the hash that
        Redis invalidates (`store.grant_watch`), else one HGET."""
        if self._watch is None:
            self._watch = GrantWatch(self.store.client, self.key)
        known, value = self._watch.lookup(field)
        raw: Any = value if known else self.store.client.hget(self.key, field)
        return None if raw is None else _split(raw)

    def close(self) -> None:
        """Close the lookup's watch connection, if one was opened."""
        if self._watch is not None:
            self._watch.close()

    def all(self) -> dict[str, tuple[str, str]]:
        """Every grant: field -> (worker, epoch)."""
        raw: dict[Any, Any] = self.store.client.hgetall(self.key)
        out: dict[str, tuple[str, str]] = {}
        for field, value in raw.items():
            found = _split(value)
            if found is not None:
                out[field.decode() if isinstance(field, bytes) else str(field)] = found
        return out

    def mine(self, worker: str) -> dict[str, str]:
        """The grants `worker` holds: field -> epoch."""
        return {f: epoch for f, (w, epoch) in self.all().items() if w == worker}

    def issue(self, grants: dict[str, str]) -> dict[str, tuple[str, str]]:
        """Record `grants` (field -> worker), each with a new epoch; returns what was written."""
        written = {f: (w, uuid.uuid4().hex[:12]) for f, w in grants.items()}
        if written:
            self.store.client.hset(
                self.key, mapping={f: f"{w}\t{e}" for f, (w, e) in written.items()}
            )
        return written

    def revoke(self, fields: list[str]) -> None:
        """Forget `fields` (publishers route those classes to the intake again)."""
        if fields:
            self.store.client.hdel(self.key, *fields)


_SCAN_LIMIT = 10_000
"""Messages read from the head of each holder's queue when looking for a task id."""


def locate_granted(plugin: Any, task_id: str) -> tuple[str, str, int] | None:
    """Where a job sent under a grant waits: (holder, grant field, jobs queued before it;
    -1 when held at the holder's gate), or None. Reads the next `_SCAN_LIMIT` messages of
    each holder's queue, then the messages workers took and did not acknowledge yet."""
    from celery_ojs_ml.store import broker as redis_intake
    from celery_ojs_ml.wire.queues import worker_queue_name

    grants = plugin.grant_book.all()
    if not grants:
        return None
    prefix = plugin.settings.store_prefix
    with plugin.app.connection_for_read() as conn:
        if conn.transport.driver_type != "redis":
            return None
        channel = conn.default_channel
        for field, (worker, _) in sorted(grants.items()):
            ahead = 0
            for key in redis_intake.queue_keys(channel, worker_queue_name(prefix, worker)):
                items = channel.client.lrange(key, -_SCAN_LIMIT, -1)  # BRPOP takes the right
                for index, raw in enumerate(items):
                    if _task_id_of(raw) == task_id:
                        return worker, field, ahead + len(items) - 1 - index
                ahead += len(items)
        taken = _taken_by(channel, task_id)  # held at a gate, or waiting in a pool
    for field, (worker, _) in sorted(grants.items()):
        if taken == worker_queue_name(prefix, worker):
            return worker, field, -1
    return None


def _taken_by(channel: Any, task_id: str) -> str | None:
    """The queue a worker took `task_id` from and has not acknowledged yet (kombu's
    unacked hash: `[message, exchange, routing key]` by delivery tag), or None."""
    key = str(getattr(channel, "global_keyprefix", "") or "") + channel.unacked_key
    for _tag, payload in channel.client.hscan_iter(key, count=1000):
        try:
            message, _exchange, routing_key = json.loads(payload)
        except (ValueError, TypeError):
            continue
        if _task_id_of(message) == task_id:
            return str(routing_key)
    return None


def _task_id_of(raw: Any) -> str | None:
    from celery_ojs_ml.store.broker import header_of

    found = header_of(raw, "id")
    return found if isinstance(found, str) else None


def end_grants_of(plugin: Any, worker: str) -> None:
    """End every grant `worker` holds, from outside the leader (RFC 27 prioritize of a job
    sent under one): the leader notices at its next pass, which this wakes, and takes the
    holder's queued jobs back; the holder gives back those held at its gate."""
    book = plugin.grant_book
    book.revoke([f for f, (w, _) in book.all().items() if w == worker])
