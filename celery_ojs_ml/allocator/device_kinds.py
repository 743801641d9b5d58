"""Which of a worker's devices a job may take when they differ: two models, MIG devices.

Key decision: on a worker that advertises each device's facts
(`Capabilities.gpu_devices`, `capabilities.devices`), a job takes only devices
of its type with enough memory and compute capability (a job of more than one
GPU: no MIG device); the others count as taken for it. A 1-GPU job takes the
smallest such device (`roomier`). Its GPUs are then judged
against those devices alone: NEVER when the worker has too few of them, WAIT
when too few are free. On a worker of alike devices nothing changes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.capabilities.devices import usable
from celery_ojs_ml.matching import Reason, Verdict
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share


def usable_for(req: MLRequirements, caps: Capabilities) -> frozenset[int] | None:
    """The devices `req` may take (a share: one device); None when the worker's are alike."""
    count = 1 if gpu_share(req) is not None else req.ext_ml_gpu_count or 0
    return usable(
        caps,
        count,
        req.ext_ml_gpu_type,
        req.ext_ml_gpu_memory_gb,
        req.ext_ml_gpu_compute_capability,
    )


def unusable(req: MLRequirements, caps: Capabilities) -> set[int]:
    """The devices `req` may not take ({} when the worker's are alike)."""
    found = usable_for(req, caps)
    return set() if found is None else set(range(caps.gpu_count)) - found


def roomier(req: MLRequirements, caps: Capabilities, taken: Collection[int]) -> set[int]:
    """For a 1-GPU job, the free devices it may take that have more memory than the
    smallest such one: it takes the smallest device that holds it (a MIG slice before a
    whole GPU), leaving the large ones for the jobs that need them."""
    facts = caps.gpu_devices
    if not facts or (req.ext_ml_gpu_count or 0) != 1:
        return set()
    free = [i for i in range(len(facts)) if i not in taken]
    if not free:
        return set()
    least = min(facts[i].memory_gb for i in free)
    return {i for i in free if facts[i].memory_gb > least}


def masked(milli: Sequence[int], req: MLRequirements, caps: Capabilities) -> tuple[int, ...]:
    """Each device's free milli-GPU, 0 on a device `req` may not take."""
    found = usable_for(req, caps)
    return tuple(m if found is None or i in found else 0 for i, m in enumerate(milli))


def kind_reasons(
    req: MLRequirements, caps: Capabilities, want: int, taken: Collection[int]
) -> list[Reason]:
    """`gpu_count` of the devices `req` may take: NEVER when fewer than `want` exist,
    WAIT when fewer are free (`taken`: devices running jobs hold)."""
    found = usable_for(req, caps)
    if found is None or want <= 0:
        return []
    free = len(found - set(taken))
    if len(found) < want:
        template = f"gpu_count {len(found)} of its kind < {{r}}"
        return [Reason("gpu_count", want, free, len(found), Verdict.NEVER, template)]
    if free < want:
        template = "gpu_count free {a} of its kind < {r}"
        return [Reason("gpu_count", want, free, len(found), Verdict.WAIT, template)]
    return []


def same_kind(caps: Capabilities, old: Sequence[int], new: Sequence[int]) -> bool:
    """Whether a running job may move from devices `old` to `new` (the warm pool):
    devices of the same facts, one for one."""
    facts = caps.gpu_devices
    if not facts:
        return True

    def kinds(devices: Sequence[int]) -> list[tuple[object, ...]]:
        found = [facts[i] for i in devices if 0 <= i < len(facts)]
        if len(found) != len(devices):
            return []
        return sorted((str(f.type), f.memory_gb, str(f.compute_capability), f.mig) for f in found)

    return bool(old) and kinds(old) == kinds(new) != []
