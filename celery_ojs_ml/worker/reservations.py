"""The reservations placed on this worker (§8.3): capacity only their jobs may use.

Key decision: the leader places reservations; the worker reads them from the
store at every subscription poll (and when a job names one it does not hold yet)
and hands exactly those placed here to its allocator (`Allocator.set_pools`).
Capacity a reservation gave back may let held jobs start: the gate pumps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery_ojs_ml.allocator import Allocator
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.store.reservations import ReservationBook, held_by

log = logging.getLogger("celery_ojs_ml.worker.core")


class ReservationHolder:
    """Keeps the allocator's reservations in step with the store (see module doc)."""

    def __init__(
        self,
        hostname: str,
        allocator: Allocator,
        lock: threading.RLock,
        parse: Callable[[Any], Any],
        on_freed: Callable[[], None],
    ) -> None:
        self.hostname, self.allocator, self.lock = hostname, allocator, lock
        self.parse, self.on_freed = parse, on_freed
        self.store: OJSStore = None  # type: ignore[assignment]
        self.book: ReservationBook = None  # type: ignore[assignment]

    def open(self, store: OJSStore) -> None:
        self.store, self.book = store, ReservationBook(store)

    def hold(self) -> None:
        """Hold exactly the reservations placed on this worker (`allocator.pools`)."""
        try:
            if not self.store.client.exists(self.book.key) and not self.allocator.pools:
                return
            held = held_by(self.book.all(), self.hostname, self.parse, time.time())
        except Exception as exc:  # keep what is held until the store answers again
            log.warning("ojs-ml: could not read the reservations: %s", exc)
            return
        with self.lock:
            before = set(self.allocator.pools)
            self.allocator.set_pools(held)
        if set(held) != before:
            log.info("ojs-ml: holding reservations %s", sorted(held) or "none")
        if before - set(held):  # capacity came back: held jobs may fit now
            self.on_freed()
