"""Dynamic reservations (OJS ML §8.3) inside one worker's allocator: pure arithmetic.

Key decision: a reservation the worker holds is a *pool*, a slice of its
counted resources carved out of the total. Jobs outside every pool see the
total less the pools (whole, used or not); a job that names a pool sees only
what is left of that pool. So "no other job uses that capacity while the
reservation is held" is a matter of counts, checked by the same `_assess` and
`_commit` paths as every job, and devices stay best-fit. A pool that ends
while jobs run inside it simply stops being carved out: those jobs count as
ordinary running jobs until they end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from celery_ojs_ml.allocator.model import Demand

PoolUse = tuple[str | None, Demand]
"""(the pool a running job runs inside, or None; what it holds)."""


def pool_of(rid: str | None, pools: Mapping[str, Demand]) -> str | None:
    """The pool a job with reservation id `rid` runs inside here, if this worker holds it."""
    return rid if rid is not None and rid in pools else None


def general_free(total: Demand, running: Iterable[PoolUse], pools: Mapping[str, Demand]) -> Demand:
    """Free for jobs outside every pool: the total less running jobs outside pools and every
    pool held whole (a pool's own jobs are inside its slice, never counted twice)."""
    outside = Demand.total(d for pool, d in running if pool is None or pool not in pools)
    inside: dict[str, Demand] = {}
    for pool, d in running:
        if pool is not None and pool in pools:
            inside[pool] = inside.get(pool, Demand()).plus(d)
    held = Demand.total(_cover(cap, inside.get(rid, Demand())) for rid, cap in pools.items())
    return total.minus(outside.plus(held))


def pool_free(rid: str, running: Iterable[PoolUse], pools: Mapping[str, Demand]) -> Demand:
    """What is left of pool `rid` for another job inside it."""
    return pools[rid].minus(Demand.total(d for pool, d in running if pool == rid))


def _cover(cap: Demand, used: Demand) -> Demand:
    """What a pool takes from the total: its size, or more if its jobs overran it."""
    return Demand(
        max(cap.gpus, used.gpus),
        max(cap.cpu_cores, used.cpu_cores),
        max(cap.memory_gb, used.memory_gb),
        max(cap.tpu_chips, used.tpu_chips),
    )
