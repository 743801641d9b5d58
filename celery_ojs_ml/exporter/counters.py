"""Counters and histograms fed by the fleet's `ojs-*` events (`EventCounters.handle`).

Key decisions:
* Each event type maps to the families it counts (`_HANDLERS`): `ojs-started`
  (wait time), `ojs-preempted`, `ojs-crashed`, `ojs-escalated`,
  `ojs-checkpoint-saved` and `ojs-progress`. Anything else is ignored.
* A queue label comes from the event, else from the job's `ojs-started` event (a
  bounded map of task id to queue), else it is empty: the task id itself is
  never a label.
* Every family keeps at most `MAX_SERIES` label sets; later new ones are counted
  under the value "other", so a misbehaving producer cannot grow a scrape without
  bound.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from celery_ojs_ml.exporter.names import (
    CRASHES,
    ESCALATIONS,
    PREEMPTIONS,
    PROGRESS,
    SAVE_BUCKETS,
    SAVE_SECONDS,
    SAVED_BYTES,
    SAVES,
    WAIT,
    WAIT_BUCKETS,
    Family,
)
from celery_ojs_ml.lru import LRU

MAX_SERIES = 1000
"""Label sets per family; beyond it new ones count under "other"."""
OTHER = "other"
_MAX_LABEL = 128
"""Longest label value kept (longer ones are cut)."""
_QUEUES_KEPT = 100_000
"""Task ids whose queue is remembered from their `ojs-started` event."""

Labels = tuple[str, ...]


def _number(value: Any) -> float | None:
    """A finite, non-negative number from an event field, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _label(value: Any) -> str:
    return value[:_MAX_LABEL] if isinstance(value, str) else ""


class _Histogram:
    """Cumulative buckets, count and sum per label set."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = buckets
        self.series: dict[Labels, tuple[list[int], list[float]]] = {}

    def observe(self, labels: Labels, value: float) -> None:
        counts, total = self.series.setdefault(labels, ([0] * (len(self.bounds) + 1), [0.0]))
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                counts[i] += 1
        counts[-1] += 1
        total[0] += value

    def family(self, family: Family) -> HistogramMetricFamily:
        out = HistogramMetricFamily(family.name, family.help, labels=family.labels)
        for labels, (counts, total) in sorted(self.series.items()):
            les = [*(repr(float(b)) for b in self.bounds), "+Inf"]
            out.add_metric(
                list(labels), buckets=list(zip(les, counts, strict=True)), sum_value=total[0]
            )
        return out


class EventCounters:
    """The event-fed families (thread-safe: the listener writes, scrapes read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[Labels, float]] = {
            f.name: {} for f in (PREEMPTIONS, CRASHES, ESCALATIONS, SAVES, SAVED_BYTES, PROGRESS)
        }
        self._histograms = {
            WAIT.name: _Histogram(WAIT_BUCKETS),
            SAVE_SECONDS.name: _Histogram(SAVE_BUCKETS),
        }
        self._queues: LRU[str, str] = LRU(_QUEUES_KEPT)

    def handle(self, event: Mapping[str, Any]) -> None:
        """Count one Celery event (a dict with `type`); unknown types are ignored."""
        handler = _HANDLERS.get(str(event.get("type")))
        if handler is not None:
            with self._lock:
                handler(self, event)

    def families(self) -> list[Metric]:
        """Every event-fed family, in catalogue order (empty ones too)."""
        with self._lock:
            return [
                self._histograms[WAIT.name].family(WAIT),
                *(self._counter(f) for f in (PREEMPTIONS, CRASHES, ESCALATIONS, SAVES)),
                self._histograms[SAVE_SECONDS.name].family(SAVE_SECONDS),
                self._counter(SAVED_BYTES),
                self._counter(PROGRESS),
            ]

    def _counter(self, family: Family) -> CounterMetricFamily:
        out = CounterMetricFamily(family.name, family.help, labels=family.labels)
        for labels, value in sorted(self._counts[family.name].items()):
            out.add_metric(list(labels), value)
        return out

    # -- what each event counts (under `_lock`) -------------------------------------------------

    def _bounded(self, series: Mapping[Labels, Any], labels: Labels) -> Labels:
        if labels in series or len(series) < MAX_SERIES:
            return labels
        return tuple(OTHER for _ in labels)

    def _add(self, family: Family, labels: Labels, amount: float = 1.0) -> None:
        series = self._counts[family.name]
        key = self._bounded(series, labels)
        series[key] = series.get(key, 0.0) + amount

    def _observe(self, family: Family, labels: Labels, value: float) -> None:
        histogram = self._histograms[family.name]
        histogram.observe(self._bounded(histogram.series, labels), value)

    def _queue(self, event: Mapping[str, Any]) -> str:
        queue, uuid = _label(event.get("queue")), event.get("uuid")
        if not queue and isinstance(uuid, str):
            queue = self._queues.get(uuid) or ""
        return queue

    def _started(self, event: Mapping[str, Any]) -> None:
        uuid, queue = event.get("uuid"), _label(event.get("queue"))
        if isinstance(uuid, str) and queue:
            self._queues[uuid] = queue
        wait = _number(event.get("wait_s"))
        if wait is not None:
            self._observe(WAIT, (_label(event.get("band")),), wait)

    def _preempted(self, event: Mapping[str, Any]) -> None:
        self._add(PREEMPTIONS, (_label(event.get("band")),))

    def _crashed(self, event: Mapping[str, Any]) -> None:
        self._add(CRASHES, (self._queue(event),))

    def _escalated(self, event: Mapping[str, Any]) -> None:
        self._add(ESCALATIONS, (_label(event.get("band_from")), _label(event.get("band_to"))))

    def _saved(self, event: Mapping[str, Any]) -> None:
        queue = self._queue(event)
        self._add(SAVES, (queue,))
        size = _number(event.get("size_bytes"))
        if size is not None:
            self._add(SAVED_BYTES, (queue,), size)
        seconds = _number(event.get("duration_s"))
        if seconds is not None:
            self._observe(SAVE_SECONDS, (), seconds)

    def _progress(self, event: Mapping[str, Any]) -> None:
        self._add(PROGRESS, (self._queue(event),))


_HANDLERS: dict[str, Callable[[EventCounters, Mapping[str, Any]], None]] = {
    "ojs-started": EventCounters._started,
    "ojs-preempted": EventCounters._preempted,
    "ojs-crashed": EventCounters._crashed,
    "ojs-escalated": EventCounters._escalated,
    "ojs-checkpoint-saved": EventCounters._saved,
    "ojs-progress": EventCounters._progress,
}
"""The event types counted, and how."""
