"""Publish-time satisfiability: could any live worker ever run this job (OJS §7.2)?

Key decision: eligibility depends only on the job's class, its logical queue and
the live workers, so it is computed once per (class, queue) per refresh of the
live-worker list (at most once a second): a producer publishing many jobs of
one kind pays a dict lookup, not a match against every worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from celery_ojs_ml.capabilities import Capabilities, parse_capabilities
from celery_ojs_ml.lru import LRU
from celery_ojs_ml.matching import match, pending_message
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.store.registry import OJSStore

LIVE_CACHE_S = 1.0
"""How long the producer's copy of the live-worker list is used before it is read again."""
_MEMO_MAX = 4096

LiveWorker = tuple[Capabilities, frozenset[str] | None]
"""A live worker's capabilities and consumed queues (None: it does not advertise them)."""


class Eligibility:
    """The live workers as a producer sees them, and why none could run a job."""

    def __init__(self, store: Callable[[], OJSStore]) -> None:
        self._store = store
        self._live: tuple[float, list[LiveWorker]] = (0.0, [])
        self._eligible: LRU[tuple[str, str], tuple[float, str | None]] = LRU(_MEMO_MAX)

    def live_workers(self) -> list[LiveWorker]:
        """(capabilities, consumed queues) of the live workers, cached for `LIVE_CACHE_S`."""
        stamp, cached = self._live
        now = time.monotonic()
        if now - stamp > LIVE_CACHE_S:
            cached = []
            for w in self._store().live_workers().values():
                queues = (w.get("info") or {}).get("queues")
                consumed = None if queues is None else frozenset(queues)
                cached.append((parse_capabilities(w["capabilities"]), consumed))
            self._live = (now, cached)
        return cached

    def reason(self, req: MLRequirements, cid: str, logical: str) -> str | None:
        """Why no live worker could ever run the job, else None.

        A worker counts if it consumes the job's logical queue and its
        capabilities satisfy the class.
        """
        live = self.live_workers()
        stamp = self._live[0]
        known = self._eligible.get((cid, logical))
        if known is not None and known[0] == stamp:
            return known[1]
        serving = [caps for caps, queues in live if queues is None or logical in queues]
        if live and not serving:
            reason: str | None = (
                f"0/{len(live)} live workers consume queue {logical!r}; start one with "
                f"`celery worker -Q {logical}`"
            )
        else:
            results = [match(req, caps) for caps in serving]
            reason = None if any(r.eligible for r in results) else pending_message(results)
        self._eligible[(cid, logical)] = (stamp, reason)
        return reason
