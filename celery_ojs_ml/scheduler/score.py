"""The placement score: which of the workers where a job fits now should take it.

Key decision: one plain number, 0-100, higher is better, shared by the scheduler and
`celery-ojs-ml explain`. It blends packing (how little the placement fragments the
fleet) with matching's soft-constraint score (preferred affinity §7.2, model locality
§11.3, the Extensions §7 spot and data-locality hints), by `Policy.affinity_weight`.
Packing follows FGD (Weng et al., ATC'23), per GPU (`scheduler.frag`): the placement
that grows the expected fragment least wins, best fit on GPUs breaks ties, then fleet
order (`score_placement`). The weights come from the trace replay (docs/scheduling.md).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_ojs_ml.allocator.sharing import FULL, after
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import NO_HINTS, FreeCapacity, Hints
from celery_ojs_ml.matching import score as soft_score
from celery_ojs_ml.scheduler.frag import Kind, Mix, by_access, growth, kind_of, with_sizes
from celery_ojs_ml.scheduler.model import (
    DEFAULT_POLICY,
    GpuAffinity,
    PendingJob,
    Policy,
    WorkerState,
)
from celery_ojs_ml.scheduler.vectors import INF, Vec, demand_of, from_free, totals_of
from celery_ojs_ml.spec.resources import MLRequirements

FRAGMENTATION_WEIGHT = 0.995
GPU_FIT_WEIGHT = 0.005
HOST_FIT_WEIGHT = 0.0
"""Reported by `explain`, not weighed: best fit on cores and memory allocates less."""
WHOLE_SCALE = 1000.0
"""Milli-GPU of fragmentation growth per unit of `fgd_points`' sigmoid: FGD's, one GPU."""
SHARE_SCALE = 500.0
"""The same where the workload holds GPU shares (`Workload.of_counts`, docs/performance.md)."""


@dataclass(frozen=True, slots=True)
class Workload:
    """How often each GPU count is asked for; FGD's target workload."""

    shares: tuple[tuple[int, float], ...] = ()
    """(GPU count, share of GPU jobs asking for it), GPU jobs only."""
    largest: int = 8
    """GPUs of the largest worker in the fleet, the scale of every GPU term."""
    mix: Mix = field(default_factory=Mix)
    """The kinds of job (CPU, GPUs, milli per GPU, models) FGD's fragment is taken over."""
    scale: float = WHOLE_SCALE
    """Milli-GPU of growth per unit of the score's sigmoid (`fgd_points`)."""

    @classmethod
    def of(cls, gpu_counts: Iterable[int], largest: int = 8) -> Workload:
        """The workload of these GPU requests (jobs without GPUs do not count)."""
        return cls.of_kinds((Kind(gpus=g) for g in gpu_counts if g > 0), largest)

    @classmethod
    def of_kinds(
        cls,
        kinds: Iterable[Kind],
        largest: int = 8,
        sizes: Iterable[int] = (),
        models: Mapping[str, int] | None = None,
    ) -> Workload:
        """The workload of these kinds of job, all of them (coverage 1: see docs/performance.md).

        `sizes`: the GPU counts of the fleet's workers, whose whole-worker jobs
        keep a share of the mix (`frag.with_sizes`). `models`: the fleet's GPUs
        of each model, which weigh kinds limited to scarce models (`frag.by_access`).
        The growth is scored at `SHARE_SCALE` when some kind asks for a GPU share:
        a fraction of a GPU then decides whether the next job fits, so finer
        points than FGD's one-GPU scale let best fit break fewer, closer ties.
        """
        return cls.of_counts(Counter(kinds), largest, sizes, models)

    @classmethod
    def of_pass(
        cls, fleet: Sequence[WorkerState], alike: Iterable[tuple[PendingJob, int]]
    ) -> Workload:
        """A pass's mix: each kind of job pending (with how many jobs share one
        requirements object) and the fleet's worker sizes."""
        kinds: Counter[Kind] = Counter()
        for job, n in alike:
            kinds[kind_of(job)] += n
        sizes = {w.caps.gpu_count for w in fleet}
        models = gpus_by_model(w.caps for w in fleet)
        return cls.of_counts(kinds, max(sizes, default=0), sizes, models)

    @classmethod
    def of_counts(
        cls,
        kinds: Counter[Kind],
        largest: int = 8,
        sizes: Iterable[int] = (),
        models: Mapping[str, int] | None = None,
    ) -> Workload:
        """`of_kinds` from each kind's number of jobs."""
        counts: Counter[int] = Counter()
        for kind, n in kinds.items():
            if kind.gpus > 0:
                counts[kind.gpus] += n
        total = sum(counts.values())
        shares = tuple(sorted((g, n / total) for g, n in counts.items())) if total else ()
        mix = by_access(with_sizes(Mix.of(kinds, coverage=1.0), sizes), models or {})
        shared = any(k.gpus > 0 and k.milli < FULL for k in kinds)
        return cls(shares, max(largest, 1), mix, SHARE_SCALE if shared else WHOLE_SCALE)

    def fragment(self, free_gpus: float) -> float:
        """Expected GPUs of `free_gpus` that the next job cannot use (FGD's F)."""
        return free_gpus * sum(p for g, p in self.shares if g > free_gpus)


def gpus_by_model(fleet: Iterable[Capabilities]) -> dict[str, int]:
    """The fleet's GPUs of each model ("" where a worker names none), for `Workload.of_counts`."""
    out: dict[str, int] = {}
    for caps in fleet:
        if caps.gpu is not None and caps.gpu_count:
            model = caps.gpu.type or ""
            out[model] = out.get(model, 0) + caps.gpu_count
    return out


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
    hints: Hints = NO_HINTS,
) -> PlacementScore:
    """The score of placing `req` on a worker with `caps` and `free` now.

    The free milli-GPU of a worker are a fragment for every kind of job in the
    workload that cannot use them; the placement that grows the expected fragment
    least wins, scored as FGD scores it (`fgd_points`, on `workload.scale`), so
    placements whose growths differ by a few tens of milli-GPU tie. Best fit on GPUs
    (fewest left over) breaks those ties, at a weight too small to trade against a
    point of fragmentation; host fit is reported but not weighed. So a CPU job takes
    the worker with the fewest free GPUs (a CPU worker first), a 1-GPU job the 1-GPU
    worker, and an idle 8-GPU worker stays whole. `spread` inverts the GPU terms
    (most left over); `dedicated` is placed like `pack` and takes the whole worker.
    """
    running = free.running_labels
    weight = policy.locality_weight
    affinity = soft_score(req, caps, locality_weight=weight, running=running, hints=hints)
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
    *,
    devices: tuple[int, ...] | None = None,
    milli: int = FULL,
    model: str = "",
) -> PlacementScore:
    """`score_placement` on counted vectors, with the soft score already known.

    `devices`: milli-GPU free per device (sharing on); None counts the free
    GPUs as untouched devices. `milli`: a share's milli-GPU (`FULL`: whole
    GPUs). `model`: the worker's GPU model, for kinds that accept only some.
    """
    scale = float(workload.largest)
    free_gpus = totals[0] if free[0] == INF else free[0]
    vec = devices if devices is not None else (FULL,) * int(free_gpus)
    kind = Kind(want[1], 1 if milli < FULL else int(want[0]), milli, memory=want[2])
    gpu_job = bool(want[0]) or milli < FULL
    grown = growth(model, free[1], vec, kind, workload.mix, free[2]) if gpu_job else None
    taken = grown[1] if grown else ()
    left = sum(after(vec, taken, milli)) / FULL
    if gpu_affinity == "spread":
        frag = gpu_fit = normalise(left, 0.0, scale)
    else:
        frag = fgd_points(grown[0] if grown else 0.0, workload.scale)
        gpu_fit = normalise(-left, -scale, 0.0)
    host = _host_fit(want, free, totals, spread=gpu_affinity == "spread")
    packing = round(
        FRAGMENTATION_WEIGHT * frag + GPU_FIT_WEIGHT * gpu_fit + HOST_FIT_WEIGHT * host, 2
    )
    w = policy.affinity_weight
    total = round((1 - w) * packing + w * affinity, 2)
    return PlacementScore(total, packing, frag, gpu_fit, host, affinity)


def fgd_points(grown: float, scale: float = WHOLE_SCALE) -> float:
    """FGD's score of a fragmentation growth (milli-GPU): 100 sigmoid(-growth / scale), cut.

    `scale`: FGD's is 1000, one GPU (`Workload.scale`).
    """
    return float(int(100.0 / (1.0 + math.exp(min(grown / scale, 700.0)))))


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
