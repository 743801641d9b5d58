"""The worker's own queue is added before celery's loop starts, and consumed only by it
(celery 5.7.0 `celery.worker.loops`; these tests fail when that changes).

Consuming earlier let a RabbitMQ message arrive for a consumer without callbacks while a
later bootstep opened a channel, and the worker stopped with `NotImplementedError:
Consumer does not have any callbacks` (seen once in a fresh-clone CI run)."""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace
from typing import Any

from celery.worker import loops

from celery_ojs_ml.worker.subscription import Subscription


def test_celerys_loops_set_the_message_callback_before_they_consume() -> None:
    for loop in (loops.asynloop, loops.synloop):
        src = inspect.getsource(loop)
        assert src.index("consumer.on_message = on_task_received") < src.index("consumer.consume()")


class _Consumer:
    def __init__(self) -> None:
        self.on_message: Any = None
        self.callbacks: list[Any] = []
        self.consumed = 0

    def consume(self) -> None:
        self.consumed += 1

    def cancel_by_queue(self, name: str) -> None:
        pass


class _Worker(Subscription):
    def __init__(self, consumer: _Consumer) -> None:
        super().__init__(SimpleNamespace(task_consumer=consumer), threading.RLock(), "own")
        self.added: list[str] = []

    def _add_queue(self, tc: Any, name: str) -> None:
        self.added.append(name)


def test_before_the_loop_starts_queues_are_added_but_not_consumed() -> None:
    consumer = _Consumer()
    worker = _Worker(consumer)
    worker.resubscribe()
    assert worker.added == ["own"] and worker.subscribed == {"own"}
    assert consumer.consumed == 0
    consumer.on_message = print  # the loop started
    worker.wanted = frozenset({"own", "more"})
    worker.resubscribe()
    assert worker.added == ["own", "more"] and consumer.consumed == 1
