"""The scheduler lock: which candidate leads the fleet (DESIGN decision 9).

A plain `SET NX PX` renewed by its holder only, as celery-redbeat's lock: another
candidate takes over when it expires. The value is `{id, since}` JSON, plus `pass_s`
(the holder's last scheduling pass, in seconds) from its first renewal on, which
`celery ojs-ml metrics` exports.
"""

from __future__ import annotations

import json
from typing import Any

from celery_ojs_ml.store.pending_records import _text, transaction
from celery_ojs_ml.store.registry import OJSStore


class LeaderLock:
    """`lead`, `resign`, `leader` on one store's `scheduler:leader` key."""

    def __init__(self, store: OJSStore) -> None:
        self.store = store
        self._r = store.client
        self._key = store.key("scheduler", "leader")

    def lead(self, candidate: str, ttl_s: float, *, pass_s: float | None = None) -> bool:
        """Take or renew the scheduler lock; True while `candidate` holds it. `pass_s`:
        written into the record by a renewal, in the same round trip."""
        ms = max(1, round(ttl_s * 1000))
        mine = self.leader()
        if mine is not None and mine.get("id") == candidate:
            value = json.dumps(mine)

            def txn(pipe: Any) -> bool:
                if _text(pipe.get(self._key) or b"") != value:
                    return False
                pipe.multi()
                if pass_s is None:
                    pipe.pexpire(self._key, ms)
                else:
                    pipe.set(self._key, json.dumps({**mine, "pass_s": pass_s}), px=ms)
                return True

            return bool(transaction(self._r, self._key, txn))
        record = json.dumps({"id": candidate, "since": self.store._clock()})
        return bool(self._r.set(self._key, record, nx=True, px=ms))

    def resign(self, candidate: str) -> None:
        """Give the lock up at once (a clean shutdown), if `candidate` holds it."""
        mine = self.leader()
        if mine is not None and mine.get("id") == candidate:
            value = json.dumps(mine)

            def txn(pipe: Any) -> None:
                if _text(pipe.get(self._key) or b"") == value:
                    pipe.multi()
                    pipe.delete(self._key)

            transaction(self._r, self._key, txn)

    def leader(self) -> dict[str, Any] | None:
        """`{id, since}` of the current scheduler, or None."""
        raw = self._r.get(self._key)
        if raw is None:
            return None
        value = json.loads(_text(raw))
        return value if isinstance(value, dict) else None
