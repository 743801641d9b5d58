"""Which devices a whole-GPU job takes, and what a share costs whole jobs (pure helpers).

Key decisions: a free set that a warm pool child is bound to comes first (its
CUDA context and models are already there), then best fit over runs of
indices (`devices.pick_devices`). A job that asks for `nvlink` between its
GPUs, on a worker that knows its links, takes only a set of NVLink peers
(`devices.pick_peers`), warm or not.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from celery_ojs_ml.allocator.devices import Peers, pick_devices, pick_peers
from celery_ojs_ml.allocator.model import Demand
from celery_ojs_ml.allocator.sharing import FULL, pick_share, share_milli
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share


def wants_peers(req: MLRequirements, peers: Peers | None) -> bool:
    """Whether the job's GPUs must be NVLink peers (and the worker knows its links)."""
    return (
        peers is not None
        and req.ext_ml_gpu_interconnect == "nvlink"
        and (req.ext_ml_gpu_count or 0) > 1
        and gpu_share(req) is None
    )


def linked(devices: Sequence[int], peers: Peers) -> bool:
    """Whether every two of `devices` are NVLink peers."""
    return all(j in peers[i] for i in devices for j in devices if i != j)


def choose_whole(
    gpu_count: int,
    taken: Collection[int],
    count: int,
    prefer: Sequence[Sequence[int]],
    peers: Peers | None,
) -> tuple[int, ...] | None:
    """`count` free devices (module doc); `peers`: only NVLink peers, None if none is free."""
    free = [i for i in range(gpu_count) if i not in taken]
    warm = [tuple(s) for s in prefer if len(s) == count and not set(s) & set(taken)]
    if peers is not None:
        warm = [s for s in warm if linked(s, peers)]
        return warm[0] if warm else pick_peers(free, count, peers)
    return warm[0] if warm and count else pick_devices(free, count)


def share_want(
    req: MLRequirements, caps: Capabilities, want: Demand, free: Sequence[int]
) -> Demand:
    """A share that would open an untouched device takes a whole GPU from whole jobs."""
    milli = share_milli(req, caps)
    device = None if milli is None else pick_share(free, milli)
    return want if device is None or free[device] < FULL else replace(want, gpus=1)
