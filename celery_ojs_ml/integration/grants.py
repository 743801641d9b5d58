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

import uuid
from typing import Any

from celery_ojs_ml.store import OJSStore

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
    from celery_ojs_ml.integration.redis_intake import wake_list
    from celery_ojs_ml.integration.routing import intake_name

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

    def lookup(self, field: str) -> tuple[str, str] | None:
        """(worker, epoch) of the grant for `field`, or None (one round trip)."""
        raw = self.store.client.hget(self.key, field)
        return None if raw is None else _split(raw)

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
