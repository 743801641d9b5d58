"""Counted resources as plain 5-tuples: GPUs, CPU cores, memory (GB), TPU chips, and
pool processes (every job takes one; `FreeCapacity.processes`). Processes are
counted so a pass knows which workers can start a job at once, but they rank
placements instead of gating them (`covers` leaves them out; see `FleetView.fit_now`).

Key decision: the fleet core does this arithmetic millions of times per pass,
so a footprint is a bare tuple rather than the allocator's `Demand` object,
but it is built from `Demand.of`, so the scheduler counts exactly what the
worker gate counts (an attribute a job leaves out counts as 0). A resource a
worker does not track (`FreeCapacity` field None) is infinite here and None
again when handed back to matching.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from celery_ojs_ml.allocator.model import Demand
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import FreeCapacity
from celery_ojs_ml.spec.resources import MLRequirements

Vec = tuple[float, float, float, float, float]
"""(gpus, cpu_cores, memory_gb, tpu_chips, processes)."""

ZERO: Vec = (0.0, 0.0, 0.0, 0.0, 0.0)
INF = math.inf
_EPS = 1e-9


def demand_of(req: MLRequirements) -> Vec:
    """The counted footprint of a job, as the worker gate counts it."""
    d = Demand.of(req)
    return (float(d.gpus), float(d.cpu_cores), float(d.memory_gb), float(d.tpu_chips), 1.0)


def totals_of(caps: Capabilities) -> Vec:
    """What a worker has in all (no host reserve), for normalising scores; its pool
    processes are not capabilities (0 here: `Slot` counts them from its free ones)."""
    return (
        float(caps.gpu_count),
        float(caps.cpu_cores or 0),
        float(caps.memory_gb or 0),
        float(caps.tpu.chip_count if caps.tpu else 0),
        0.0,
    )


def from_free(free: FreeCapacity) -> Vec:
    """A worker's reported free capacity; an untracked resource is unlimited."""
    return (
        INF if free.gpus is None else float(free.gpus),
        INF if free.cpu_cores is None else float(free.cpu_cores),
        INF if free.memory_gb is None else float(free.memory_gb),
        INF if free.tpu_chips is None else float(free.tpu_chips),
        INF if free.processes is None else float(free.processes),
    )


def to_free(v: Vec, running_labels: tuple[Mapping[str, str], ...] = ()) -> FreeCapacity:
    """The matching view of a free vector (infinite becomes untracked again)."""

    def back(x: float) -> float | None:
        return None if x == INF else x

    gpus, tpu, processes = back(v[0]), back(v[3]), back(v[4])
    return FreeCapacity(
        gpus=None if gpus is None else int(gpus),
        cpu_cores=back(v[1]),
        memory_gb=back(v[2]),
        tpu_chips=None if tpu is None else int(tpu),
        running_labels=running_labels,
        processes=None if processes is None else int(processes),
    )


def plus(a: Vec, b: Vec) -> Vec:
    """Element-wise sum."""
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], a[4] + b[4])


def sum_of(vs: Iterable[Vec]) -> Vec:
    """The sum of many vectors."""
    out = ZERO
    for v in vs:
        out = plus(out, v)
    return out


def minus(a: Vec, b: Vec) -> Vec:
    """Element-wise difference (may go negative: a timeline level under a hold)."""
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3], a[4] - b[4])


def neg(a: Vec) -> Vec:
    """Element-wise negation."""
    return (-a[0], -a[1], -a[2], -a[3], -a[4])


def clip(a: Vec) -> Vec:
    """Negative amounts as 0."""
    return (max(a[0], 0.0), max(a[1], 0.0), max(a[2], 0.0), max(a[3], 0.0), max(a[4], 0.0))


def lowest(a: Vec, b: Vec) -> Vec:
    """Element-wise minimum."""
    return (
        min(a[0], b[0]),
        min(a[1], b[1]),
        min(a[2], b[2]),
        min(a[3], b[3]),
        min(a[4], b[4]),
    )


def covers(have: Vec, want: Vec) -> bool:
    """Whether `have` holds `want` in every resource `want` uses, pool processes aside
    (they rank placements, `FleetView.fit_now`; they do not make a job wait)."""
    return (
        (want[0] <= 0 or want[0] <= have[0] + _EPS)
        and (want[1] <= 0 or want[1] <= have[1] + _EPS)
        and (want[2] <= 0 or want[2] <= have[2] + _EPS)
        and (want[3] <= 0 or want[3] <= have[3] + _EPS)
    )  # not processes: a job that finds every process busy waits in the pool's queue


def finite(v: Vec) -> Vec:
    """Untracked (infinite) resources as 0, for sums that must stay finite."""
    return (
        0.0 if v[0] == INF else v[0],
        0.0 if v[1] == INF else v[1],
        0.0 if v[2] == INF else v[2],
        0.0 if v[3] == INF else v[3],
        0.0 if v[4] == INF else v[4],
    )
