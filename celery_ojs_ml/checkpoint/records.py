"""Checkpoint metadata in Redis: sequence numbers, the atomic commit, retention (OJS ML §9.2).

Key decision: a commit is one MULTI/EXEC (`commit`) that sets `last`, appends to the
FIFO `history` and trims it to `max_count`, so a reader sees the old or the new
checkpoint, never a mix; MULTI rather than Lua keeps fakeredis (without lupa) working.
Eviction is a queue (`expired`), not a side effect of the commit, so a failed payload
delete is retried at the next save and never un-commits anything. Only committed
metadata is read for resume: an uploaded payload whose commit never happened does
not exist (§9.2). The keys, and the read of the last record every side needs, are
in `store.checkpoints`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from celery_ojs_ml.checkpoint.model import CheckpointError, CheckpointMeta
from celery_ojs_ml.checkpoint.preempt import LeaseLost
from celery_ojs_ml.store.checkpoints import Keys, last_raw, last_raws
from celery_ojs_ml.store.leases import taken_back_key
from celery_ojs_ml.store.registry import OJSStore

__all__ = ["Keys", "commit", "last_checkpoint", "last_checkpoints", "next_sequence"]


def next_sequence(store: OJSStore, job_id: str) -> int:
    """Allocate the next sequence number of `job_id` (1, 2, ...); never reused.

    Sequence numbers only name payload directories, so gaps are harmless: each commit
    allocates the next one in its own round trip (`Committed.next_sequence`), and a
    save pays no extra round trip for it.
    """
    return int(store.client.incr(Keys.of(store, job_id).seq))


@dataclass(frozen=True, slots=True)
class Committed:
    """What a commit reports back."""

    queued: int
    """Retired checkpoints whose payload is still to delete."""
    next_sequence: int
    """A sequence number allocated in the same round trip, for the job's next save."""


def commit(
    store: OJSStore,
    meta: CheckpointMeta,
    max_count: int,
    lease_token: str | None = None,
    final: dict[str, Any] | None = None,
) -> Committed:
    """Record `meta` as the job's last checkpoint and retire what exceeds `max_count`.

    With `lease_token` (the token of the lease this copy of the job runs
    under), the commit is fenced: it happens only if the job's lease still
    carries that token, or is absent because it was not written yet (not
    because a claimer re-published this copy's job and released it:
    `taken_back_key`), checked and applied in one WATCH/MULTI. Otherwise
    another worker took the job over and `LeaseLost` is raised; nothing is
    committed. `final` (JSON-able) marks the job done in the same step
    (`Keys.final`).
    """
    keys = Keys.of(store, meta.job_id)
    record = meta.to_json()
    lease = store.lease_key(meta.job_id)
    with store.client.pipeline(transaction=True) as pipe:
        while True:
            try:
                if lease_token is not None:
                    pipe.watch(lease)  # type: ignore[no-untyped-call]
                    if _lost(pipe, store, meta.job_id, lease, lease_token):
                        pipe.reset()
                        raise LeaseLost(meta.job_id, meta.sequence)
                    pipe.multi()
                _queue_commit(pipe, keys, record, max_count, final)
                *_, evicted, _, queued, next_sequence = pipe.execute()
                break
            except redis.WatchError:
                continue  # the lease was refreshed meanwhile: look again
    store.replicated()  # before a payload is evicted: a failover must not bring back its record
    if evicted:
        queued = store.client.rpush(keys.expired, *evicted)
    return Committed(int(queued), int(next_sequence))


def _queue_commit(
    pipe: Any, keys: Keys, record: str, max_count: int, final: dict[str, Any] | None
) -> None:
    """The commit's writes, in a MULTI; their last four replies are what `commit` reads."""
    if final is not None:
        pipe.set(keys.final, json.dumps(final))
    pipe.set(keys.last, record)
    pipe.rpush(keys.history, record)
    pipe.lrange(keys.history, 0, -(max_count + 1))
    pipe.ltrim(keys.history, -max_count, -1)
    pipe.llen(keys.expired)
    pipe.incr(keys.seq)


def final_record(job_id: str, result: Any) -> dict[str, Any]:
    """The record of a final save; its result must survive JSON, as a result backend's."""
    try:
        json.dumps(result)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"the result of {job_id}'s final checkpoint is not JSON ({exc}); pass a JSON "
            "value, e.g. ckpt.save(epoch=epoch, final=True, result={'loss': 0.1})"
        ) from exc
    return {"result": result}


def _lost(pipe: Any, store: OJSStore, job_id: str, lease: str, token: str) -> bool:
    """Whether the copy holding `token` lost its job (read inside the commit's WATCH)."""
    raw = pipe.get(lease)
    if raw:
        return bool(_token(raw) != token)
    return bool(pipe.exists(taken_back_key(store, job_id, token)))


def _token(raw: Any) -> Any:
    try:
        return json.loads(raw).get("token")
    except (ValueError, AttributeError):
        return None


def last_checkpoint(store: OJSStore, job_id: str) -> CheckpointMeta | None:
    """The committed `last_checkpoint` of `job_id`, or None."""
    raw = last_raw(store, job_id)
    return CheckpointMeta.from_json(_bytes(raw)) if raw is not None else None


def last_checkpoints(store: OJSStore, job_ids: list[str]) -> dict[str, CheckpointMeta | None]:
    """`last_checkpoint` of many jobs in one round trip (the leader, every pass)."""
    if not job_ids:
        return {}
    raws = last_raws(store, job_ids)
    return {
        j: CheckpointMeta.from_json(_bytes(r)) if r is not None else None
        for j, r in zip(job_ids, raws, strict=True)
    }


def list_checkpoints(store: OJSStore, job_id: str) -> list[CheckpointMeta]:
    """The retained committed checkpoints of `job_id`, oldest first."""
    raw: list[Any] = store.client.lrange(Keys.of(store, job_id).history, 0, -1)
    return [CheckpointMeta.from_json(_bytes(r)) for r in raw]


def expired(store: OJSStore, job_id: str) -> list[tuple[str, CheckpointMeta]]:
    """Evicted checkpoints whose payload is still to delete, with their raw records.

    The trimmed entries go onto this queue right after the commit, their payloads are
    deleted after that, and an entry leaves it only once its payload is gone
    (`forget_expired`). A process that dies between the commit and the push leaks
    those payloads (orphans, like an uncommitted payload; `delete_checkpoints` with
    the storage URI removes them); it never loses or corrupts a commit.
    """
    raw: list[Any] = store.client.lrange(Keys.of(store, job_id).expired, 0, -1)
    return [(_bytes(r).decode(), CheckpointMeta.from_json(_bytes(r))) for r in raw]


def forget_expired(store: OJSStore, job_id: str, raw: str) -> None:
    """Drop one entry from the eviction queue once its payload is gone."""
    store.client.lrem(Keys.of(store, job_id).expired, 1, raw)


def drop_all(store: OJSStore, job_id: str) -> list[CheckpointMeta]:
    """Delete every record of `job_id` atomically; returns the checkpoints that were known."""
    keys = Keys.of(store, job_id)
    with store.client.pipeline(transaction=True) as pipe:
        pipe.lrange(keys.history, 0, -1)
        pipe.lrange(keys.expired, 0, -1)
        pipe.delete(*keys.all())
        history, queued, _ = pipe.execute()
    return [CheckpointMeta.from_json(_bytes(r)) for r in [*queued, *history]]


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
