"""The queues one consumer reads: its own (`-Q`, `add_consumer`) and its ML queue.

Key decisions:
* An ML job reaches a worker only through its own queue (`wire.queues.worker_queue_name`):
  the leader delivers assignments there, and grants publish there.
* Queues are added and cancelled on the consumer's own task consumer (never
  process-wide) and reapplied in `start()`, which also runs after every reconnect.
* A queue is declared once per connection and bound once per channel: the bound
  `Queue` is kept and put back as it is (kombu's `add_queue` copies the queue and
  its exchange every time).
"""

from __future__ import annotations

import threading
from typing import Any

from celery_ojs_ml.celery_internals import put_back_queue
from celery_ojs_ml.wire.queues import ml_queue
from celery_ojs_ml.worker.wakeup import wake_consumer


class Subscription:
    """Which queues this consumer reads (see module doc)."""

    def __init__(self, consumer: Any, lock: threading.RLock, own_queue: str) -> None:
        self.c, self.lock = consumer, lock
        self.wanted = frozenset((own_queue,))
        """The ML queues to consume: the worker's own queue."""
        self.subscribed: set[str] = set()
        self.logical: frozenset[str] = frozenset()
        """The worker's own (non-ML) queues: it takes ML jobs of these logical queues only."""
        self._declared: set[str] = set()
        self._bound: dict[str, Any] = {}

    def open(self, consumer: Any) -> None:
        """At every consumer start: what the consumer reads now (after a reconnect too)."""
        with self.lock:
            self._declared, self._bound = set(), {}
            self.subscribed = {q.name for q in consumer.task_consumer.queues if ".ml." in q.name}
            self.logical = self.own_queues()

    def close(self) -> None:
        with self.lock:
            self.subscribed = set()

    def refresh(self) -> None:
        """Pick up `celery control add_consumer/cancel_consumer`, then (re)apply the queues."""
        with self.lock:
            self.logical = self.own_queues()
        self.resubscribe()

    def own_queues(self) -> frozenset[str]:
        """The queues this consumer reads besides ML queues (`-Q`, `add_consumer`).

        Like plain Celery, a worker runs only the jobs of the queues it was told
        to consume; it advertises them and the leader places accordingly.
        """
        tc = self.c.task_consumer
        if tc is None:
            return self.logical
        return frozenset(q.name for q in tc.queues if ".ml." not in q.name)

    def resubscribe(self) -> None:
        """Consume exactly the wanted queues, on this consumer only.

        Before celery's loop has set the consumer's `on_message` (worker start-up),
        queues are only added: the loop's own `consume()` starts them. Consuming
        earlier let an AMQP message arrive while a later bootstep opened a channel,
        for a consumer without callbacks, which stopped the worker
        (`NotImplementedError: Consumer does not have any callbacks`).
        """
        wanted = self.wanted
        if wanted == self.subscribed:
            return
        with self.lock:
            tc = self.c.task_consumer
            if tc is None or wanted == self.subscribed:
                return
            for name in sorted(self.subscribed - wanted):
                tc.cancel_by_queue(name)
            added = sorted(wanted - self.subscribed)
            for name in added:
                self._add_queue(tc, name)
            started = bool(tc.on_message or tc.callbacks)
            if added and started:
                tc.consume()
            self.subscribed = set(wanted)
        if added and started:
            wake_consumer(tc)

    def _add_queue(self, tc: Any, name: str) -> None:
        """Put the queue `name` back on the consumer `tc` (it starts on `tc.consume()`)."""
        bound = self._bound.get(name)
        if bound is not None and put_back_queue(tc, name, bound):
            return
        self._bound[name] = tc.add_queue(ml_queue(name, declare=name not in self._declared))
        self._declared.add(name)
