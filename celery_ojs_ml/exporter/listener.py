"""`EventListener`: a thread that feeds the fleet's `ojs-*` Celery events to a sink.

Key decisions:
* One `app.events.Receiver` bound with the routing key `ojs.#`, so the broker
  delivers only the plugin's own events, not the fleet's task events (on Redis the
  binding becomes a `PSUBSCRIBE` pattern).
* The receiver's queue exists only while it consumes: events sent before it
  started, or while the broker was away, are not counted. A lost connection is
  retried every `retry_s` seconds; the thread never dies of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ROUTING_KEY = "ojs.#"
"""The `ojs-*` events: an event's routing key is its type with dots for dashes."""
Sink = Callable[[dict[str, Any]], None]


class EventListener:
    """Receives `ojs-*` events from the app's broker in a daemon thread (see module doc)."""

    def __init__(self, app: Any, sink: Sink, *, retry_s: float = 2.0) -> None:
        self.app, self.sink, self.retry_s = app, sink, retry_s
        self.ready = threading.Event()
        """Set once the receiver consumes (its queue is bound)."""
        self._stop = threading.Event()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, name="ojs-ml-events", daemon=True)

    def start(self) -> EventListener:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop receiving (within about a second) and wait for the thread."""
        self._stop.set()
        if self._receiver is not None:
            self._receiver.should_stop = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._receive()
            except Exception as exc:  # the broker went away: try again
                log.warning("ojs-ml metrics: event stream: %s; retrying", exc)
            self.ready.clear()
            self._stop.wait(self.retry_s)

    def _receive(self) -> None:
        with self.app.connection_for_read() as conn:
            receiver = self.app.events.Receiver(
                conn, handlers={"*": self._on_event}, routing_key=ROUTING_KEY
            )
            # kombu's ConsumerMixin hook, called once the queue is bound (and instead of
            # Celery's worker wake-up, which the exporter does not need)
            receiver.on_consume_ready = lambda *_, **__: self.ready.set()
            self._receiver = receiver
            if self._stop.is_set():
                return
            receiver.capture(limit=None, timeout=None, wakeup=False)

    def _on_event(self, event: dict[str, Any]) -> None:
        try:
            self.sink(event)
        except Exception as exc:  # one odd event must not stop the stream
            log.warning("ojs-ml metrics: could not count %s: %s", event.get("type"), exc)
