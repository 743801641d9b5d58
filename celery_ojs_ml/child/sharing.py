"""GPU sharing in the pool child: the share a task runs on, and the limits it can apply.

Responsibility: read the share the gate put in the request (`self.request.ojs_gpu_share`,
`worker.sharing.share_info`), and apply the limits that exist beyond the
allocator's accounting: the MPS per-client memory limit when an MPS daemon runs,
and torch's caching-allocator cap when the task asks for it (`limit_torch_memory`).

Key decision: the allocator's accounting is the guarantee the scheduler and the
gate keep (the sum of shares on a device never passes its VRAM); enforcement
inside the device is best effort and opt-in, because CUDA has no per-process
VRAM limit without MPS. Both limits apply to the child's CUDA context, so they are
set before the task body runs, on device 0 (`CUDA_VISIBLE_DEVICES` shows one).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery_ojs_ml.allocator.sharing import FULL
from celery_ojs_ml.wire.headers import SHARE

log = logging.getLogger(__name__)

HEADER_SHARE = SHARE
"""Request field of a share task: {"device", "milli", "memory_gb"} (`worker.sharing`)."""
MPS_PIPE = "CUDA_MPS_PIPE_DIRECTORY"
MPS_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


def share_of(task: Any) -> dict[str, Any] | None:
    """The running task's share (`share_info`), or None for a whole-GPU or plain task."""
    found = getattr(getattr(task, "request", None), HEADER_SHARE, None)
    return found if isinstance(found, dict) else None


def mps_running() -> bool:
    """Whether this process talks to an MPS daemon (its pipe directory is set)."""
    return bool(os.environ.get(MPS_PIPE))


def mps_limit(share: dict[str, Any]) -> str | None:
    """`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` for a share: `0=<MiB>M` (device 0 in the child)."""
    gb = share.get("memory_gb")
    if not isinstance(gb, int | float) or gb <= 0:
        return None
    return f"0={int(gb * 1024)}M"


def set_share_env(request: Any) -> None:
    """`task_prerun`: under MPS, cap the child's device memory at the share's VRAM."""
    share = getattr(request, HEADER_SHARE, None)
    if not isinstance(share, dict) or not mps_running():
        return
    limit = mps_limit(share)
    if limit is not None:
        request.ojs_saved_mps = os.environ.get(MPS_LIMIT)
        os.environ[MPS_LIMIT] = limit


def restore_share_env(request: Any) -> None:
    """`task_postrun`: put the MPS limit back as it was before the task."""
    if not hasattr(request, "ojs_saved_mps"):
        return
    saved = request.ojs_saved_mps
    if saved is None:
        os.environ.pop(MPS_LIMIT, None)
    else:
        os.environ[MPS_LIMIT] = saved


def limit_torch_memory(task: Any) -> bool:
    """Cap torch's CUDA allocator at the task's share of its device; True if capped.

    Calls `torch.cuda.set_per_process_memory_fraction(milli / 1000, device=0)`.
    A no-op (False) for a task that does not share a GPU, or where torch or
    CUDA is not available. Call it at the top of the task body, before
    allocating tensors; torch then raises OutOfMemoryError past the share.
    """
    share = share_of(task)
    if share is None:
        return False
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    torch.cuda.set_per_process_memory_fraction(int(share["milli"]) / FULL, device=0)
    return True
