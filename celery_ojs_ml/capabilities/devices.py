"""Per-device GPU facts: a host with two GPU models, and MIG devices (OJS ML §3.2, §11).

Responsibility: the devices NVML reports (`GpuDevice`), their advertised facts
(`Capabilities.gpu_devices`), which of them can serve a job (`usable`), and the
`gpu` object a job is matched against on such a host (`job_gpu`).

Key decisions:
- A host whose devices differ (models, memory, MIG) advertises every device in
  allocation order, and `gpu` summarises all of them the way that never
  overclaims (the most common model, the smallest memory, the lowest compute
  capability). A job is matched and allocated against the devices that satisfy
  its type, memory and compute capability, never against the summary, so a job
  for the minority model runs there, on devices of its model only.
- A MIG device (NVML `nvmlDeviceGetMigDeviceHandleByIndex`) is a device of its
  own, with its slice of memory and its `MIG-` UUID, which CUDA_VISIBLE_DEVICES
  names; its GPU is not offered whole while MIG is on. CUDA gives a process one
  MIG device, so a job asking for more than one GPU never gets a MIG device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from celery_ojs_ml.capabilities.model import Capabilities, GpuCapability, GpuDeviceFact


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One GPU (or MIG device) as NVML reports it, for the allocator's device pinning."""

    index: int
    """NVML index (a MIG device: its GPU's)."""
    name: str
    uuid: str | None
    gpu_type: str
    memory_gb: float
    compute_capability: str | None
    nvlink: bool
    peers: frozenset[int] | None = None
    """NVML indices of the devices it reaches over NVLink (NVML P2P status); None: unknown."""
    mig: bool = False
    """A MIG device: `uuid` is its `MIG-...` UUID."""

    @property
    def token(self) -> str:
        """How CUDA_VISIBLE_DEVICES names it when nothing was inherited: the NVML index
        (with `CUDA_DEVICE_ORDER=PCI_BUS_ID`), a MIG device by its UUID."""
        return self.uuid if self.mig and self.uuid else str(self.index)


def differ(devices: Sequence[GpuDevice]) -> bool:
    """Whether a host's devices need per-device facts: models or memory differ, or MIG."""
    kinds = {(d.gpu_type, d.memory_gb, d.compute_capability) for d in devices}
    return len(kinds) > 1 or any(d.mig for d in devices)


def facts_of(devices: Sequence[GpuDevice]) -> tuple[GpuDeviceFact, ...]:
    """The advertised facts of each device, in allocation order."""
    return tuple(
        GpuDeviceFact(
            type=d.gpu_type,
            memory_gb=d.memory_gb,
            compute_capability=d.compute_capability,
            mig=d.mig,
        )
        for d in devices
    )


def most_common_type(devices: Sequence[GpuDevice]) -> str | None:
    """The most common model (ties: the model of the first device); None without devices."""
    if not devices:
        return None
    counts = Counter(d.gpu_type for d in devices)
    top = max(counts.values())
    return next(d.gpu_type for d in devices if counts[d.gpu_type] == top)


def usable(
    caps: Capabilities,
    count: int,
    gpu_type: str | None = None,
    memory_gb: float | None = None,
    compute_capability: str | None = None,
) -> frozenset[int] | None:
    """Allocation indices of the devices that can serve a job asking for `count` GPUs of
    this type, memory and compute capability; None when the worker's devices are alike."""
    if not caps.gpu_devices:
        return None
    return frozenset(
        i
        for i, d in enumerate(caps.gpu_devices)
        if (not gpu_type or d.type == gpu_type)
        and (memory_gb is None or d.memory_gb >= memory_gb)
        and (compute_capability is None or _cc_ok(d.compute_capability, compute_capability))
        and not (d.mig and count > 1)
    )


def job_gpu(
    caps: Capabilities,
    count: int,
    gpu_type: str | None = None,
    memory_gb: float | None = None,
    compute_capability: str | None = None,
) -> GpuCapability | None:
    """The `gpu` a job is matched against: on a host of alike devices its `gpu`; else the
    devices that serve it, or, when none does, the closest ones, each constraint in turn
    (so the reason names the first constraint no device meets, with the best value)."""
    gpu, facts = caps.gpu, caps.gpu_devices
    if gpu is None or not facts:
        return gpu
    stages = [
        list(range(len(facts))),
        [i for i in range(len(facts)) if not gpu_type or facts[i].type == gpu_type],
        [i for i in range(len(facts)) if i in (usable(caps, 1, gpu_type, memory_gb) or ())],
        sorted(usable(caps, 1, gpu_type, memory_gb, compute_capability) or ()),
        sorted(usable(caps, count, gpu_type, memory_gb, compute_capability) or ()),
    ]
    found = stages[-1]
    if found:
        return _summary(gpu, [facts[i] for i in found], best=False)
    last = max(n for n, group in enumerate(stages) if group)
    best = _summary(gpu, [facts[i] for i in stages[last]], best=True)
    return best.model_copy(update={"count": 0}) if last == len(stages) - 2 else best


def _summary(gpu: GpuCapability, group: list[GpuDeviceFact], *, best: bool) -> GpuCapability:
    """`gpu` narrowed to `group`: its model when they share one, and their smallest
    (`best`: largest) memory and compute capability."""
    types = {d.type for d in group}
    memory = [d.memory_gb for d in group]
    ccs = [d.compute_capability for d in group if d.compute_capability]
    pick = max if best else min
    return gpu.model_copy(
        update={
            "type": types.pop() if len(types) == 1 else gpu.type,
            "count": len(group),
            "memory_gb": pick(memory),
            "compute_capability": pick(ccs, key=_cc_key) if len(ccs) == len(group) else None,
            "nvlink_group": None,
        }
    )


def _cc_key(cc: str) -> tuple[int, ...]:
    return tuple(int(p) for p in cc.split("."))


def _cc_ok(have: str | None, want: str) -> bool:
    return have is not None and _cc_key(have) >= _cc_key(want)
