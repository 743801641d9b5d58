"""The leader's broker connection: the intake consumer, its producer, its publish batch.

Key decision: one connection per leadership, opened on the first step and
dropped whole on any error or lost lock (the next step opens a new one). On
Redis the intake's lists are read directly (`store.broker.RedisIntake`) and
deliveries are pushed by the assignment's own Lua call (`direct`); elsewhere
through kombu's consumer and producer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from kombu import Consumer, Producer  # type: ignore[attr-defined]

from celery_ojs_ml.store import broker
from celery_ojs_ml.store.broker import RedisIntake
from celery_ojs_ml.wire.queues import ml_queue

log = logging.getLogger("celery_ojs_ml.leader.loop")

_POP_BATCH = 64
"""Most messages the Redis intake moves per round trip."""


class BrokerLink:
    """The connection state of one leadership; every attribute is None while closed."""

    def __init__(self, app: Any, queue: str) -> None:
        self.app = app
        self.queue = queue
        self.conn: Any = None
        self.consumer: Any = None
        self.reliable: RedisIntake | None = None
        """The Redis intake; None on other brokers (kombu's consumer reads instead)."""
        self.producer: Any = None
        self.direct: Any = None
        """The broker channel whose lists the assignment's Lua call pushes deliveries
        onto (`broker.direct_channel`); None: publish through kombu."""
        self.events: Any = None
        """The leader's event dispatcher, made on the first event."""
        self.declared: set[str] = set()
        """Worker queues declared on this connection."""

    def connect(self, on_message: Callable[[Any], None]) -> None:
        """Open the connection unless open; messages a dead leader took are recovered."""
        if self.conn is not None:
            return
        conn = self.app.connection_for_write()
        conn.ensure_connection(max_retries=1)
        channel = conn.channel()
        consumer: Any = Consumer(channel, queues=[ml_queue(self.queue)], on_message=on_message)  # type: ignore[no-untyped-call]
        self.conn, self.consumer = conn, consumer
        if broker.supports(channel):  # read the lists ourselves: see `store.broker`
            self.reliable = RedisIntake(channel, self.queue, _POP_BATCH)
            for message in self.reliable.recover():
                on_message(message)
        else:
            consumer.qos(prefetch_count=256)
            consumer.consume()
        self.producer = Producer(conn.channel())  # type: ignore[no-untyped-call]
        self.direct = broker.direct_channel(self.app, self.queue, self.producer.channel)
        self.declared = set()

    def close(self) -> None:
        """Drop the connection; what was taken and not settled waits for the next leader."""
        conn, self.conn, self.consumer, self.producer = self.conn, None, None, None
        self.direct = self.events = None
        reliable, self.reliable = self.reliable, None
        if reliable is not None:
            reliable.close()  # what it took and did not settle waits in its processing list
        if conn is not None:
            try:
                conn.release()
            except Exception as exc:
                log.debug("ojs-ml: closing the scheduler connection: %s", exc)

    def batch(self) -> Any:
        """kombu's publish batch (kombu >= 5.7; one pipeline on Redis), else nothing.

        Each assignment is recorded in the store before the batch is flushed, so
        a leader that dies in between leaves assignments that are taken back
        after `ojs_ml_assignment_timeout_s`, as any lost delivery is.
        """
        batch = getattr(self.producer, "batch", None)
        return batch() if batch is not None else contextlib.nullcontext()

    def settle_in(self) -> Callable[[Any], None] | None:
        """With the store on the broker's Redis (`direct`), the intake messages admitted
        so far are settled in the assignments' pipeline (`RedisIntake.done_in`)."""
        reliable = self.reliable
        return reliable.done_in if reliable is not None and self.direct is not None else None

    def settle(self) -> None:
        """Take the acked messages off the Redis intake's processing list."""
        if self.reliable is not None:
            self.reliable.done()
