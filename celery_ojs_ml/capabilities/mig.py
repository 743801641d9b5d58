"""MIG devices through NVML: a GPU in MIG mode is offered as its MIG devices.

With `probe`, the NVML-reading code of the layer (the module is injected, so
tests run it against `celery_ojs_ml.testing.fake_nvml.FakeNVML`).

Key decision: a GPU whose current MIG mode is enabled is replaced by the MIG
devices NVML lists under it (`nvmlDeviceGetMaxMigDeviceCount` slots, each read
through `nvmlDeviceGetMigDeviceHandleByIndex`; an empty slot raises and is
skipped), each with its own memory and `MIG-` UUID (`capabilities.devices`). A
GPU that cannot say (no MIG support, an older driver) is offered whole. A MIG
device without a UUID cannot be named in CUDA_VISIBLE_DEVICES, so it is left out.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from celery_ojs_ml.capabilities.devices import GpuDevice

MIG_ENABLED = 1
"""`NVML_DEVICE_MIG_ENABLE`: the current mode of a GPU in MIG mode."""
_PROFILE = re.compile(r"\b\d+g\.(\d+)gb\b")
"""A MIG profile in a device name, `3g.40gb`: its memory in marketing GB."""
_SNAP = 0.10


def mig_devices(
    module: Any,
    gpu: GpuDevice,
    handle: Any,
    errors: tuple[type[BaseException], ...],
    floor_gb: Any,
) -> list[GpuDevice] | None:
    """The MIG devices of `gpu`, or None when it is not in MIG mode (offer it whole).
    `floor_gb` turns a byte count into the advertised GB (`probe.gib_floor`)."""
    try:
        current, _pending = module.nvmlDeviceGetMigMode(handle)
        if current != getattr(module, "NVML_DEVICE_MIG_ENABLE", MIG_ENABLED):
            return None
        slots = int(module.nvmlDeviceGetMaxMigDeviceCount(handle))
    except (AttributeError, TypeError, ValueError):
        return None
    except errors:
        return None
    found = []
    for slot in range(slots):
        try:
            mig = module.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            uuid = _text(module.nvmlDeviceGetUUID(mig))
            total = module.nvmlDeviceGetMemoryInfo(mig).total
            name = _text(module.nvmlDeviceGetName(mig))
        except errors:
            continue
        found.append(
            replace(
                gpu,
                name=name,
                uuid=uuid,
                memory_gb=_memory(name, total, floor_gb),
                nvlink=False,
                peers=frozenset(),
                mig=True,
            )
        )
    return found


def _memory(name: str, total: int, floor_gb: Any) -> float:
    """A MIG device's memory: its profile's GB (`3g.40gb`: 40) when NVML's reading is
    within 10% of it, as a whole GPU's VRAM snaps to its catalogue size; else floored."""
    reading = float(floor_gb(total))
    found = _PROFILE.search(name.lower())
    if found is not None and abs(reading - int(found[1])) <= int(found[1]) * _SNAP:
        return float(found[1])
    return reading


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
