"""The placement score: which of the workers where a job fits now should take it.

Key decision: one plain number, 0-100, higher is better, shared by the
scheduler and `celery-ojs-ml explain`. It blends packing (how little the
placement fragments the fleet) with matching's soft-constraint score
(preferred affinity §7.2, model locality §11.3), by `Policy.affinity_weight`.

Packing follows FGD (Weng et al., ATC'23): the free GPUs of a worker are a
fragment for every kind of job in the workload that asks for more than are
free. Placing a job changes the expected fragment,
`F(f) = f * P(gpus > f)`, by `F(f - g) - F(f)`; the placement that grows it
least wins. Best fit on GPUs (fewest left over) and then on host resources
break what FGD leaves even, so a 1-GPU job takes the 1-GPU worker and an idle
8-GPU worker stays whole. `spread` inverts the GPU terms (most left over);
`dedicated` is placed like `pack` and takes the whole worker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import FreeCapacity
from celery_ojs_ml.matching import score as soft_score
from celery_ojs_ml.scheduler.model import DEFAULT_POLICY, GpuAffinity, Policy
from celery_ojs_ml.scheduler.vectors import INF, Vec, demand_of, from_free, totals_of
from celery_ojs_ml.spec.resources import MLRequirements

FRAGMENTATION_WEIGHT = 0.7
GPU_FIT_WEIGHT = 0.2
HOST_FIT_WEIGHT = 0.1


@dataclass(frozen=True, slots=True)
class Workload:
    """How often each GPU count is asked for; FGD's target workload."""

    shares: tuple[tuple[int, float], ...] = ()
    """(GPU count, share of GPU jobs asking for it), GPU jobs only."""
    largest: int = 8
    """GPUs of the largest worker in the fleet, the scale of every GPU term."""

    @classmethod
    def of(cls, gpu_counts: Iterable[int], largest: int = 8) -> Workload:
        """The workload of these GPU requests (jobs without GPUs do not count)."""
        counts = Counter(g for g in gpu_counts if g > 0)
        total = sum(counts.values())
        shares = tuple(sorted((g, n / total) for g, n in counts.items())) if total else ()
        return cls(shares, max(largest, 1))

    def fragment(self, free_gpus: float) -> float:
        """Expected GPUs of `free_gpus` that the next job cannot use (FGD's F)."""
        return free_gpus * sum(p for g, p in self.shares if g > free_gpus)


@dataclass(frozen=True, slots=True)
class PlacementScore:
    """The score of one placement and its parts, each 0-100."""

    total: float
    packing: float
    fragmentation: float
    gpu_fit: float
    host_fit: float
    affinity: float

    def as_dict(self) -> dict[str, Any]:
        """JSON form for `explain`."""
        return {
            "total": self.total,
            "packing": self.packing,
            "fragmentation": self.fragmentation,
            "gpu_fit": self.gpu_fit,
            "host_fit": self.host_fit,
            "affinity": self.affinity,
        }


def normalise(value: float, low: float, high: float) -> float:
    """`value` on [low, high] as 0-100, clipped (the one score scale)."""
    if high <= low:
        return 100.0
    return round(100.0 * min(max((value - low) / (high - low), 0.0), 1.0), 2)


def score_placement(
    req: MLRequirements,
    caps: Capabilities,
    free: FreeCapacity,
    *,
    workload: Workload,
    gpu_affinity: GpuAffinity = "pack",
    policy: Policy = DEFAULT_POLICY,
) -> PlacementScore:
    """The score of placing `req` on a worker with `caps` and `free` now (see module doc)."""
    running = free.running_labels
    affinity = soft_score(req, caps, locality_weight=policy.locality_weight, running=running)
    return placement(
        demand_of(req), from_free(free), totals_of(caps), affinity, workload, gpu_affinity, policy
    )


def placement(
    want: Vec,
    free: Vec,
    totals: Vec,
    affinity: float,
    workload: Workload,
    gpu_affinity: GpuAffinity,
    policy: Policy,
) -> PlacementScore:
    """`score_placement` on counted vectors, with the soft score already known."""
    scale = float(workload.largest)
    free_gpus = totals[0] if free[0] == INF else free[0]
    left = max(free_gpus - want[0], 0.0)
    if gpu_affinity == "spread":
        frag = gpu_fit = normalise(left, 0.0, scale)
    else:
        grown = workload.fragment(left) - workload.fragment(free_gpus)
        frag = normalise(-grown, -scale, scale)
        gpu_fit = normalise(-left, -scale, 0.0)
    host = _host_fit(want, free, totals, spread=gpu_affinity == "spread")
    packing = round(
        FRAGMENTATION_WEIGHT * frag + GPU_FIT_WEIGHT * gpu_fit + HOST_FIT_WEIGHT * host, 2
    )
    w = policy.affinity_weight
    total = round((1 - w) * packing + w * affinity, 2)
    return PlacementScore(total, packing, frag, gpu_fit, host, affinity)


def _host_fit(want: Vec, free: Vec, totals: Vec, *, spread: bool) -> float:
    """Best fit on cores and memory: the share of the worker left over, inverted."""
    shares = []
    for i in (1, 2):
        if totals[i] > 0 and free[i] != INF:
            shares.append(max(free[i] - want[i], 0.0) / totals[i])
    if not shares:
        return 100.0
    left = sum(shares) / len(shares)
    return normalise(left, 0.0, 1.0) if spread else normalise(-left, -1.0, 0.0)
