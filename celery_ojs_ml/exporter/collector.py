"""`OJSMLCollector`: the prometheus_client collector behind `celery ojs-ml metrics`.

Key decision: gauges are read from the store on every scrape (`StoreReader`, one
round trip in the steady state), so the exporter keeps no state that can go stale
and any number of exporters agree; counters and histograms come from the Celery
event stream (`EventCounters`, fed by `EventListener`), as Flower's and
celery-exporter's do, and count from the exporter's start. A store that does not
answer leaves the gauges without samples for that scrape; the counters are served.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import redis
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from celery_ojs_ml.exporter.counters import EventCounters
from celery_ojs_ml.exporter.gauges import families
from celery_ojs_ml.exporter.reads import Snapshot, StoreReader
from celery_ojs_ml.store.registry import OJSStore

log = logging.getLogger(__name__)


class OJSMLCollector(Collector):
    """The fleet's metrics: the store's state on each `collect()`, plus event counters."""

    def __init__(self, store: OJSStore, counters: EventCounters | None = None) -> None:
        self.reader = StoreReader(store)
        self.counters = counters if counters is not None else EventCounters()
        self._lock = threading.Lock()
        """Scrapes may overlap (the HTTP server runs one thread per request); the reader's
        caches are read and replaced by one scrape at a time."""

    def snapshot(self) -> Snapshot | None:
        """The store's state now, or None (logged) when it does not answer."""
        with self._lock:
            try:
                return self.reader.read()
            except redis.RedisError as exc:
                log.warning("ojs-ml metrics: the store did not answer: %s", exc)
                return None

    def collect(self) -> Iterator[Metric]:
        """Every family of `metric_names()`, gauges first."""
        yield from families(self.snapshot())
        yield from self.counters.families()
