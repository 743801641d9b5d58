"""The leader's view of the pending set: read whole once, then only what changed.

Responsibility: the records a pass decides on. Reading them all on every pass
cost O(N) store work per pass under a backlog of N jobs.

Key decisions: the index (admission order) is read on every pass; a record is
read again only when it is new to the view or marked changed (every state
change of the pending set marks the job in the same transaction; admissions,
written only by the leader, are handed over as written). Every `FULL_EVERY_S`
(longer for a large set) the view reads everything again, so a change that
was not marked is seen within that time; so does a new leader's first pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from celery_ojs_ml.store.pending import PendingBook

FULL_EVERY_S = 2.0
"""Longest time a change the view was not told of can go unseen, for up to `FULL_PER_READ`
records; a larger pending set is read whole proportionally less often (10,000 records:
every 20 s), so full re-reads cost the same per second however long the backlog."""
FULL_PER_READ = 1000


class PendingView:
    """`PendingBook.records(lean=True)`, read incrementally (see module doc)."""

    def __init__(self, book: PendingBook, clock: Callable[[], float] = time.monotonic) -> None:
        self.book = book
        self._clock = clock
        self._records: dict[str, dict[str, Any]] = {}
        self._full_at: float | None = None
        self.reads = 0
        """Records read from the store so far (for tests and benchmarks)."""

    def put(self, task_id: str, record: dict[str, Any]) -> None:
        """A record this leader just wrote (an admission): held without a read."""
        self._records[task_id] = record

    def reset(self) -> None:
        """Forget everything: the next pass reads every record (a new leadership)."""
        self._records = {}
        self._full_at = None

    def records(self, taken: tuple[list[str], set[str]] | None = None) -> dict[str, dict[str, Any]]:
        """Every waiting or assigned job: `{task_id: record}`, in admission order.

        `taken`: the index and the change marks, already read with the pass's other
        reads (`leader.pass_reads`); None: read them here."""
        ids, changed = taken if taken is not None else self.book.index_and_changes()
        now = self._clock()
        every = FULL_EVERY_S * max(1.0, len(ids) / FULL_PER_READ)
        if self._full_at is None or now - self._full_at >= every:
            self._full_at = now
            fresh = self._read(ids)
            self._records = {i: fresh[i] for i in ids if i in fresh}
        else:
            self._records = self._update(ids, changed)
        return dict(self._records)

    def _read(self, want: list[str]) -> dict[str, dict[str, Any]]:
        fresh = self.book.read(want) if want else {}
        self.reads += len(want)
        return fresh

    def _update(self, ids: list[str], changed: set[str]) -> dict[str, dict[str, Any]]:
        """Between full reads: set operations (C speed) on the index, reads and Python work
        only for what changed (the index itself is still walked once, in C)."""
        held = self._records
        index = set(ids)
        for task_id in held.keys() - index:  # started, cancelled or expired
            del held[task_id]
        new = index - held.keys()  # admitted by another leader, or read before their write
        want = [i for i in ids if i in new] if new else []
        want += [i for i in changed if i in index and i not in new]
        fresh = self._read(want)
        for task_id in want:
            if task_id in fresh:
                held[task_id] = fresh[task_id]
            else:
                held.pop(task_id, None)
        if len(held) == len(ids) and list(held) == ids:
            return held  # new jobs came last in the index, as they mostly do: kept in order
        # In index order, in C: a job read as started or gone since the index was read
        # (`want`, not in `fresh`) is in `ids` but no longer held.
        ordered: dict[str, Any] = dict(zip(ids, map(held.get, ids), strict=True))
        for task_id in index - held.keys():
            del ordered[task_id]
        return ordered
