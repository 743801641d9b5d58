"""Committed checkpoint records in Redis (OJS ML §9.2): their keys and the last one's read.

The task-side helper (`checkpoint.records`) writes them in its two-phase commit;
every side that re-publishes or dead-letters a job reads the job's last committed
checkpoint here, as the JSON record the commit wrote, so the store needs nothing
of the checkpoint package.

Layout (prefix `ojs`, job id `<job>`):
    ojs:{ml}:ckpt:<job>:seq      int     last allocated sequence number (INCR; gaps are fine)
    ojs:{ml}:ckpt:<job>:last     string  §9.2 `last_checkpoint` JSON
    ojs:{ml}:ckpt:<job>:history  list    committed checkpoints, oldest first (<= max_count)
    ojs:{ml}:ckpt:<job>:expired  list    evicted checkpoints whose payload is still to delete
    ojs:{ml}:ckpt:<job>:final    string  `{"sequence", "result"}` once the job committed its
                                         final checkpoint (`save(final=True)`): it is done
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from celery_ojs_ml.store.registry import OJSStore


@dataclass(frozen=True, slots=True)
class Keys:
    """The Redis keys of one job's checkpoints."""

    seq: str
    last: str
    history: str
    expired: str
    final: str

    @classmethod
    def of(cls, store: OJSStore, job_id: str) -> Keys:
        """The keys of `job_id` in `store`."""
        return cls(
            seq=store.key("ckpt", job_id, "seq"),
            last=store.key("ckpt", job_id, "last"),
            history=store.key("ckpt", job_id, "history"),
            expired=store.key("ckpt", job_id, "expired"),
            final=store.key("ckpt", job_id, "final"),
        )

    def all(self) -> tuple[str, ...]:
        """Every key, for deletion."""
        return (self.seq, self.last, self.history, self.expired, self.final)


def last_raw(store: OJSStore, job_id: str) -> Any:
    """The stored JSON of `job_id`'s last committed checkpoint, or None."""
    return store.client.get(Keys.of(store, job_id).last)


def last_raws(store: OJSStore, job_ids: list[str]) -> list[Any]:
    """`last_raw` of many jobs in one round trip, in order."""
    found: list[Any] = store.client.mget([Keys.of(store, j).last for j in job_ids])
    return found


def last_checkpoint_of(store: OJSStore, task_id: str) -> dict[str, Any] | None:
    """The committed last checkpoint of a job as a JSON-able dict (the §9.2 record that
    travels in `ojs_last_checkpoint`), or None."""
    raw = last_raw(store, task_id)
    if raw is None:
        return None
    record = json.loads(raw)
    return record if isinstance(record, dict) else None


def final_of(store: OJSStore, job_id: str) -> dict[str, Any] | None:
    """`{"sequence", "result"}` of the job's final checkpoint, or None: a job that has
    one committed is done, and a copy of it delivered again does not run its body."""
    raw = store.client.get(Keys.of(store, job_id).final)
    if raw is None:
        return None
    record = json.loads(raw)
    return record if isinstance(record, dict) else None
