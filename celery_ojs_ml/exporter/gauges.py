"""The gauge families of one scrape, built from a `Snapshot` of the store (no I/O).

Key decisions:
* GPUs per worker: `allocated` is capacity minus free, so the two states add up to
  the worker's GPUs (GPUs a reservation holds idle count as allocated). Workers
  without GPUs have no `ojs_ml_gpus` series.
* GPU-share VRAM is reported only for workers that share GPUs (their snapshot has
  `gpu_free_milli`): `total` is the VRAM of all their GPUs, `allocated` the milli-GPU
  of each running share times its device's VRAM; GB are 10^9 bytes.
* A family with nothing to report is still served, without samples, so every name
  of `metric_names()` is in every scrape's `# HELP` lines.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from celery_ojs_ml.exporter.names import (
    BUDGET,
    DEAD,
    GPUS,
    JOBS,
    LEADER,
    PASS,
    RESERVATIONS,
    SHARE,
    WORKERS,
    Family,
)
from celery_ojs_ml.exporter.reads import Snapshot

_GB = 1e9
_FULL_MILLI = 1000


def _family(family: Family) -> GaugeMetricFamily:
    return GaugeMetricFamily(family.name, family.help, labels=family.labels)


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else None


def families(snap: Snapshot | None) -> Iterator[Metric]:
    """Every store-read family; without a snapshot (the store did not answer), empty."""
    if snap is None:
        yield from (_family(f) for f in (GPUS, JOBS, WORKERS, LEADER, PASS, DEAD))
        yield from (_family(f) for f in (BUDGET, RESERVATIONS, SHARE))
        return
    yield gpus(snap)
    yield jobs(snap)
    yield GaugeMetricFamily(WORKERS.name, WORKERS.help, value=len(snap.workers))
    yield from leader(snap)
    yield GaugeMetricFamily(DEAD.name, DEAD.help, value=snap.dead)
    yield budgets(snap)
    reservations = _family(RESERVATIONS)
    for state, count in sorted(snap.reservations.items()):
        reservations.add_metric([state], count)
    yield reservations
    yield shares(snap)


def _gpu(record: dict[str, Any]) -> dict[str, Any]:
    caps = record.get("capabilities") or {}
    gpu = (caps.get("capabilities", caps) or {}).get("gpu")
    return gpu if isinstance(gpu, dict) else {}


def gpus(snap: Snapshot) -> GaugeMetricFamily:
    """`ojs_ml_gpus{worker, gpu_type, state}`."""
    out = _family(GPUS)
    for name, record in sorted(snap.workers.items()):
        free = record.get("free") or {}
        total = _number((free.get("capacity") or {}).get("gpu_count")) or 0.0
        if total <= 0:
            continue
        idle = min(total, _number((free.get("free") or {}).get("gpu_count")) or 0.0)
        gpu_type = str(_gpu(record).get("type") or "")
        out.add_metric([name, gpu_type, "free"], idle)
        out.add_metric([name, gpu_type, "allocated"], total - idle)
    return out


def jobs(snap: Snapshot) -> GaugeMetricFamily:
    """`ojs_ml_jobs{state, band, queue}`."""
    out = _family(JOBS)
    for state, counts in (("pending", snap.pending), ("running", snap.running)):
        for (band, queue), count in sorted(counts.items()):
            out.add_metric([state, band, queue], count)
    return out


def leader(snap: Snapshot) -> Iterator[GaugeMetricFamily]:
    """`ojs_ml_leader{leader}` and `ojs_ml_scheduler_pass_seconds`."""
    who, took = _family(LEADER), _family(PASS)
    record = snap.leader
    if record is not None:
        who.add_metric([str(record["id"])], 1)
        seconds = _number(record.get("pass_s"))
        if seconds is not None:
            took.add_metric([], seconds)
    yield who
    yield took


def budgets(snap: Snapshot) -> GaugeMetricFamily:
    """`ojs_ml_budget_gpus{queue, state}`: the leader's last report of each budget."""
    out = _family(BUDGET)
    for queue, report in sorted(snap.budgets.items()):
        if not isinstance(report, dict):
            continue
        used, limit = _number(report.get("gpus")), _number(report.get("max_total_gpus"))
        if used is not None:
            out.add_metric([str(queue), "used"], used)
        if limit is not None:
            out.add_metric([str(queue), "limit"], limit)
    return out


def shares(snap: Snapshot) -> GaugeMetricFamily:
    """`ojs_ml_gpu_share_bytes{worker, state}` of the workers that share GPUs."""
    out = _family(SHARE)
    for name, record in sorted(snap.workers.items()):
        free = record.get("free") or {}
        device_gb = _number(_gpu(record).get("memory_gb"))
        if "gpu_free_milli" not in free or not device_gb:
            continue
        count = len(free["gpu_free_milli"] or ())
        milli = sum(_number(a.get("gpu_milli")) or 0.0 for a in free.get("allocations") or ())
        out.add_metric([name, "allocated"], milli / _FULL_MILLI * device_gb * _GB)
        out.add_metric([name, "total"], count * device_gb * _GB)
    return out
