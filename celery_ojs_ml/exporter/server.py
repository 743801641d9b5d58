"""`Exporter`: the collector, the event listener and the HTTP server of `ojs-ml metrics`.

Key decision: prometheus_client's own threaded HTTP server on a registry of its
own that holds only `OJSMLCollector` (no process or platform collectors: the
exporter describes the fleet, not itself); it serves `/metrics` on any path, as
prometheus_client does.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from celery_ojs_ml.exporter.collector import OJSMLCollector
from celery_ojs_ml.exporter.counters import EventCounters
from celery_ojs_ml.exporter.listener import EventListener
from celery_ojs_ml.store.registry import OJSStore


class Exporter:
    """Serves an app's fleet metrics on `address:port` (`port=0`: any free port)."""

    def __init__(
        self,
        store: OJSStore,
        app: Any = None,
        *,
        address: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.counters = EventCounters()
        self.collector = OJSMLCollector(store, self.counters)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.listener = None if app is None else EventListener(app, self.counters.handle)
        self.address, self.port = address, port
        self._server: Any = None

    def start(self) -> int:
        """Start the event listener and the HTTP server; returns the port served."""
        if self.listener is not None:
            self.listener.start()
        self._server, _ = start_http_server(self.port, addr=self.address, registry=self.registry)
        self.port = int(self._server.server_port)
        return self.port

    def stop(self) -> None:
        """Stop serving and receiving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.listener is not None:
            self.listener.stop()
