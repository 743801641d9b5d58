"""The GPU share a task is told about, computed by the gate in the worker's main process.

Key decision: the allocator accounts shares in milli-GPUs; the task is told its
device, its milli-GPU and, where known, its VRAM in GB (`self.request.ojs_gpu_share`),
which the pool child turns into limits (`child.sharing`).
"""

from __future__ import annotations

from typing import Any

from celery_ojs_ml.allocator import Allocation
from celery_ojs_ml.allocator.sharing import FULL
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.spec.resources import MLRequirements


def share_info(alloc: Allocation, req: MLRequirements, caps: Capabilities) -> dict[str, Any]:
    """What a share task is told: its device, milli-GPU, and VRAM in GB when known.

    `memory_gb` is the job's own `ext_ml_gpu_memory_gb` for a VRAM share, else
    the fraction of the device's VRAM (None when the worker does not know it).
    """
    device_gb = caps.gpu.memory_gb if caps.gpu else None
    if req.ojs_ml_gpu_share is True:
        memory_gb = req.ext_ml_gpu_memory_gb
    else:
        memory_gb = None if not device_gb else round(device_gb * alloc.gpu_milli / FULL, 3)
    return {"device": alloc.devices[0], "milli": alloc.gpu_milli, "memory_gb": memory_gb}
