"""GPU fragmentation of a worker, per GPU, as FGD defines it (Weng et al., ATC'23).

Key decisions:

* **A fragment is capacity a typical job cannot use** (`fragment`), for want of
  GPUs, CPU, memory or the right GPU model. The worker's fragmentation is the
  expectation over the workload (`Mix`: each kind with its share of jobs, a kind
  that may use only a scarce GPU model weighing more, `by_access`).
* **Per GPU.** Free capacity is a vector of milli-GPU per device
  (`allocator.sharing`), so a half-used GPU is a fragment for a whole-GPU job and
  not for a small share. A placement is scored by how much it grows fragmentation
  on the devices the worker's allocator will give it (`growth`), so the score and
  the gate agree. Pure and cheap: plain tuples and ints, memoised by worker state.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from celery_ojs_ml.allocator.sharing import FULL, after, milli_of_fraction, milli_of_gb, place
from celery_ojs_ml.scheduler.model import PendingJob
from celery_ojs_ml.spec.resources import gpu_share

PRIOR_WEIGHT = 0.1
"""Share of the workload mix given to whole-worker jobs of the fleet's sizes (`with_sizes`)."""
DEVICE_GB = 80.0
"""VRAM assumed for a VRAM share in the workload mix, where no worker is named yet."""


@dataclass(frozen=True, slots=True)
class Kind:
    """A kind of job in the workload: CPU, GPUs, milli per GPU, accepted GPU models."""

    cpu: float = 0.0
    gpus: int = 0
    milli: int = FULL
    models: frozenset[str] = frozenset()
    """GPU models it accepts; empty accepts any."""
    memory: float = 0.0
    """Host memory, in the unit of the free memory it is compared with (GB live)."""


@dataclass(frozen=True, slots=True, eq=False)
class Mix:
    """The target workload: kinds and their shares of jobs, shares summing to 1.

    Compared and hashed by identity, so a memo keyed on it stays cheap; build
    it with `of`, `with_sizes` or `interned`, which return the same instance
    for the same kinds and shares, so the memo also hits across passes.
    """

    kinds: tuple[tuple[Kind, float], ...] = ()

    @staticmethod
    def interned(kinds: tuple[tuple[Kind, float], ...]) -> Mix:
        """The one `Mix` of these kinds and shares (a bounded table of recent mixes)."""
        hit = _MIXES.get(kinds)
        if hit is None:
            if len(_MIXES) >= _MIXES_MAX:
                _MIXES.clear()
            hit = _MIXES[kinds] = Mix(kinds)
        return hit

    @classmethod
    def of(cls, kinds: Iterable[Kind] | Counter[Kind], coverage: float = 0.95) -> Mix:
        """The most common kinds that together make `coverage` of the jobs (FGD's typical jobs).

        Most common first, ties by larger demand; shares renormalised to sum to 1.
        `kinds`: one per job, or each kind's number of jobs.
        """
        counts = Counter(kinds)
        total = sum(counts.values())
        ranked = sorted(
            counts.items(),
            key=lambda kc: (
                -kc[1],
                -kc[0].cpu,
                -kc[0].milli,
                -kc[0].gpus,
                sorted(kc[0].models),
                -kc[0].memory,
            ),
        )
        kept: list[tuple[Kind, int]] = []
        covered = 0
        for kind, n in ranked:
            if total and covered >= coverage * total:
                break
            kept.append((kind, n))
            covered += n
        return cls.interned(tuple((k, n / covered) for k, n in kept) if covered else ())


def with_sizes(mix: Mix, sizes: Iterable[int], weight: float = PRIOR_WEIGHT) -> Mix:
    """`mix` plus whole-worker jobs of each fleet size that no kind in it asks for yet.

    The jobs still to come are unknown; a worker-sized job is the one that a
    fragmented fleet turns away, so a size the mix lacks gets `weight` / number
    of sizes (all of it when the mix is empty). A size the mix has keeps its
    own share: `bench/replay.py --mode fgd` measured that adding weight to
    sizes the trace already holds allocates less.
    """
    whole = sorted({s for s in sizes if s > 0})
    seen = {k.gpus for k, _ in mix.kinds if k.milli >= FULL}
    missing = [s for s in whole if s not in seen]
    if not missing:
        return mix
    extra = 1.0 if not mix.kinds else weight * len(missing) / len(whole)
    kinds = [(k, share * (1 - extra)) for k, share in mix.kinds]
    kinds += [(Kind(gpus=s), extra / len(missing)) for s in missing]
    return Mix.interned(tuple(kinds))


def by_access(mix: Mix, gpus_by_model: Mapping[str, int]) -> Mix:
    """`mix` with each kind's share divided by the square root of the fleet's GPUs it may use.

    FGD counts a worker whose GPU model a kind does not accept as all fragment for
    that kind, so a job is drawn to the models that the most constrained jobs
    refuse, however many GPUs those jobs have elsewhere; with the GPU-type
    constraints of the trace (gpuspec33), unconstrained jobs filled the few
    models that constrained jobs needed and those failed from 17 % load. Weighing
    a kind by `1 / sqrt(share of the fleet's GPUs it accepts)` keeps the models
    that few kinds may use for them (`bench/replay.py --mode fgd`, docs/performance.md).
    `gpus_by_model`: the fleet's GPUs of each model; empty leaves `mix` as it is.
    """
    total = sum(gpus_by_model.values())
    if not total or not any(k.models for k, _ in mix.kinds):
        return mix
    weighed = []
    for kind, share in mix.kinds:
        usable = sum(n for m, n in gpus_by_model.items() if not kind.models or m in kind.models)
        weighed.append((kind, share / math.sqrt(max(usable, 1) / total)))
    scale = sum(w for _, w in weighed)
    return Mix.interned(tuple((k, w / scale) for k, w in weighed))


_MIXES: dict[tuple[tuple[Kind, float], ...], Mix] = {}
_MIXES_MAX = 256


def kind_of(job: PendingJob) -> Kind:
    """A pending job's kind (a VRAM share counts at its milli on an 80 GB device)."""
    req = job.req
    share = gpu_share(req)
    if share is None:
        milli = FULL
    elif share is True:
        milli = milli_of_gb(req.ext_ml_gpu_memory_gb or DEVICE_GB, DEVICE_GB)
    else:
        milli = milli_of_fraction(share)
    gpus = 1 if share is not None else req.ext_ml_gpu_count or 0
    models = frozenset({req.ext_ml_gpu_type}) if req.ext_ml_gpu_type else frozenset()
    memory = float(req.ext_ml_memory_gb or 0)
    return Kind(float(req.ext_ml_cpu_cores or 0), gpus, milli, models, memory)


def fragment(
    model: str, cpu_free: float, gpus: Sequence[int], kind: Kind, mem_free: float = math.inf
) -> int:
    """Milli-GPU of a worker in this state that a job of `kind` cannot use.

    All of its free milli-GPU when the kind cannot start there at all (too few GPUs
    with enough milli left, too few CPU cores or too little memory, a GPU model it
    does not accept, or no GPU asked: a CPU-only job uses no GPU), else the milli
    left on the GPUs too full for one of its GPUs.
    """
    left = sum(gpus)
    if (
        kind.gpus <= 0
        or (kind.models and model not in kind.models)
        or kind.cpu > cpu_free
        or kind.memory > mem_free
    ):
        return left
    usable = [g for g in gpus if g >= kind.milli]
    if len(usable) < kind.gpus:
        return left
    return left - sum(usable)


def fragmentation(
    model: str, cpu_free: float, gpus: Sequence[int], mix: Mix, mem_free: float = math.inf
) -> float:
    """The worker's expected fragment over the workload `mix`, milli-GPU (memoised)."""
    return _fragmentation(model, cpu_free, mem_free, tuple(sorted(gpus)), mix)


@functools.lru_cache(maxsize=1 << 16)
def _fragmentation(
    model: str, cpu_free: float, mem_free: float, gpus: tuple[int, ...], mix: Mix
) -> float:
    return sum(share * fragment(model, cpu_free, gpus, kind, mem_free) for kind, share in mix.kinds)


def growth(
    model: str,
    cpu_free: float,
    gpus: Sequence[int],
    want: Kind,
    mix: Mix,
    mem_free: float = math.inf,
) -> tuple[float, tuple[int, ...]] | None:
    """How much placing `want` grows fragmentation, and the devices it takes; None if no fit.

    The devices are the allocator's choice (`allocator.sharing.place`).
    """
    if want.cpu > cpu_free or (want.models and model not in want.models):
        return None
    devices = place(gpus, want.gpus, want.milli) if want.gpus else ()
    if devices is None:
        return None
    rest = after(gpus, devices, want.milli)
    now = fragmentation(model, cpu_free, gpus, mix, mem_free)
    later = fragmentation(model, cpu_free - want.cpu, rest, mix, mem_free - want.memory)
    return later - now, devices
