"""The Prometheus exporter of the fleet (`celery ojs-ml metrics`), a process of its own.

It reads the store on every scrape (workers, GPUs, pending and running jobs, the
leader, budgets, reservations, dead letters) and counts the fleet's `ojs-*` events
(waits, preemptions, crashes, escalations, checkpoints, progress). docs/metrics.md
lists every metric.
"""

from celery_ojs_ml.exporter.collector import OJSMLCollector
from celery_ojs_ml.exporter.counters import EventCounters
from celery_ojs_ml.exporter.listener import EventListener
from celery_ojs_ml.exporter.names import metric_names
from celery_ojs_ml.exporter.server import Exporter

__all__ = ["EventCounters", "EventListener", "Exporter", "OJSMLCollector", "metric_names"]
