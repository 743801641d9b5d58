"""The scheduler lock: a mixin of `pending.PendingBook` (split out to keep modules small).

A plain `SET NX PX` renewed by its holder only, as celery-redbeat's lock: another
candidate takes over when it expires.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from celery_ojs_ml.store.pending_admit import _text
from celery_ojs_ml.store.registry import OJSStore


class LeaderLock:
    """`lead`, `resign`, `leader` (see module doc)."""

    store: OJSStore
    _r: Any
    _leader: str
    _transaction: Callable[..., Any]

    def lead(self, candidate: str, ttl_s: float) -> bool:
        """Take or renew the scheduler lock; True while `candidate` holds it."""
        ms = max(1, round(ttl_s * 1000))
        mine = self.leader()
        if mine is not None and mine.get("id") == candidate:
            value = json.dumps(mine)

            def txn(pipe: Any) -> bool:
                if _text(pipe.get(self._leader) or b"") != value:
                    return False
                pipe.multi()
                pipe.pexpire(self._leader, ms)
                return True

            return bool(self._transaction(self._leader, txn))
        record = json.dumps({"id": candidate, "since": self.store._clock()})
        return bool(self._r.set(self._leader, record, nx=True, px=ms))

    def resign(self, candidate: str) -> None:
        """Give the lock up at once (a clean shutdown), if `candidate` holds it."""
        mine = self.leader()
        if mine is not None and mine.get("id") == candidate:
            value = json.dumps(mine)

            def txn(pipe: Any) -> None:
                if _text(pipe.get(self._leader) or b"") == value:
                    pipe.multi()
                    pipe.delete(self._leader)

            self._transaction(self._leader, txn)

    def leader(self) -> dict[str, Any] | None:
        """`{id, since}` of the current scheduler, or None."""
        raw = self._r.get(self._leader)
        if raw is None:
            return None
        value = json.loads(_text(raw))
        return value if isinstance(value, dict) else None
