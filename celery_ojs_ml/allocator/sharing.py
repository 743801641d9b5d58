"""GPU sharing by VRAM: which device a share takes, and the ledger that keeps shares safe.

One unit, the milli-GPU: a device holds `FULL` = 1000 milli, and a share asks for
a VRAM amount (`ext_ml_gpu_memory_gb`, rounded *up*) or a fraction of one GPU. The
trace replay (`bench/replay.py`) uses the same unit (the Alibaba trace's `gpu_milli`).

Key decision: whole jobs and shares never mix on a device. A device is untouched,
shared or held whole; a job that does not share takes only untouched devices, a
share the best-fitting device no whole job holds (`pick_share`), so untouched
devices stay whole for the jobs that need whole GPUs. Pure, on plain ints, so the
replay can call it millions of times.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence

from celery_ojs_ml.allocator.devices import pick_devices
from celery_ojs_ml.allocator.model import AllocatorError
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import Reason, Verdict
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share

FULL = 1000
"""Milli-GPU in one device."""


def milli_of_gb(gb: float, device_gb: float) -> int:
    """VRAM `gb` of a device of `device_gb` as milli-GPU, rounded up (never under-counts)."""
    if device_gb <= 0:
        raise ValueError(f"device VRAM must be > 0 GB to share it by VRAM, got {device_gb}")
    return min(FULL, max(1, math.ceil(gb / device_gb * FULL - 1e-9)))


def milli_of_fraction(fraction: float) -> int:
    """A fraction of one GPU (0 < f <= 1) as milli-GPU, rounded up."""
    if not 0 < fraction <= 1:
        raise ValueError(f"a GPU share is a fraction in (0, 1], got {fraction}")
    return min(FULL, max(1, math.ceil(fraction * FULL - 1e-9)))


def untouched(free: Sequence[int]) -> list[int]:
    """Indices of devices nobody uses (free = `FULL`): the only ones a whole job takes."""
    return [i for i, left in enumerate(free) if left >= FULL]


def pick_share(free: Sequence[int], want: int) -> int | None:
    """The device a share of `want` milli takes: best fit, None if none fits.

    `free` is each device's milli left, 0 for a device a whole job holds. Best fit:
    the device with the least milli left that still fits (lowest index on a tie), so
    partly used devices fill up first. The live allocator and the replay both use
    this one rule.
    """
    best: int | None = None
    for i, left in enumerate(free):
        if left >= want and (best is None or left < free[best]):
            best = i
    return best


def pick_whole(free: Sequence[int], count: int) -> tuple[int, ...] | None:
    """`count` untouched devices by the allocator's contiguous best fit, None if too few."""
    idle = untouched(free)
    if len(idle) < count:
        return None
    return pick_devices(idle, count)


def place(free: Sequence[int], count: int, milli: int) -> tuple[int, ...] | None:
    """Devices for a job of `count` GPUs at `milli` each (`FULL`: whole), None if it cannot fit.

    A share (milli < FULL) is one device; a whole job takes untouched devices.
    """
    if count <= 0:
        return ()
    if milli >= FULL:
        return pick_whole(free, count)
    if count != 1:
        raise ValueError(f"a GPU share is one device, got {count} devices at {milli} milli")
    device = pick_share(free, milli)
    return None if device is None else (device,)


def after(free: Sequence[int], devices: Sequence[int], milli: int) -> tuple[int, ...]:
    """`free` once `devices` each lose `milli` (a whole job: all of each device)."""
    out = list(free)
    for i in devices:
        out[i] -= FULL if milli >= FULL else milli
    return tuple(out)


class ShareLedger:
    """Milli taken on each device of one worker, by job key (the invariant's owner).

    Invariant, checked on every take: per device, the shares sum to at most
    `FULL`, and a device held whole carries no share.
    """

    def __init__(self, devices: int) -> None:
        self._taken: dict[Hashable, tuple[int, int]] = {}
        self._free = [FULL] * devices

    def free(self) -> tuple[int, ...]:
        """Milli left on each device (0 where a whole job holds it)."""
        return tuple(self._free)

    def take(self, key: Hashable, device: int, milli: int) -> None:
        """Record a share (or, with `FULL`, a whole device); refuse to oversubscribe."""
        if key in self._taken:
            raise AllocatorError(f"share key {key!r} is already held; release it first")
        if not 0 <= device < len(self._free):
            raise AllocatorError(f"device {device} is not one of this worker's {len(self._free)}")
        whole = milli >= FULL
        if (whole and self._free[device] < FULL) or self._free[device] < milli:
            raise AllocatorError(
                f"device {device} has {self._free[device]} milli-GPU left, "
                f"{'a whole job needs all 1000' if whole else f'the share asks {milli}'}; "
                "refusing to oversubscribe its VRAM"
            )
        self._free[device] -= FULL if whole else milli
        self._taken[key] = (device, FULL if whole else milli)

    def release(self, key: Hashable) -> tuple[int, int] | None:
        """Give back what `key` holds: (device, milli), or None if it holds nothing."""
        held = self._taken.pop(key, None)
        if held is not None:
            self._free[held[0]] += held[1]
        return held

    def shares(self) -> dict[Hashable, tuple[int, int]]:
        """Every holder's (device, milli)."""
        return dict(self._taken)

    def take_job(self, key: Hashable, devices: Sequence[int], milli: int) -> None:
        """Record a job: a share (`milli` > 0) on its one device, else each device whole."""
        if milli:
            self.take(key, devices[0], milli)
            return
        for i in devices:
            self.take((key, i), i, FULL)

    def release_job(self, key: Hashable, devices: Sequence[int]) -> None:
        """Give back whatever `take_job(key, devices, ...)` recorded."""
        self.release(key)
        for i in devices:
            self.release((key, i))


def share_milli(req: MLRequirements, caps: Capabilities) -> int | None:
    """The milli-GPU a share job (`ojs_ml_gpu_share`) takes on `caps`' devices.

    None when the job is no share, or shares by VRAM on a worker whose
    `gpu.memory_gb` is unknown (`share_reasons` says why it never runs there).
    """
    share = gpu_share(req)
    if share is None:
        return None
    if share is not True:
        return milli_of_fraction(share)
    device_gb = caps.gpu.memory_gb if caps.gpu else None
    if not device_gb or req.ext_ml_gpu_memory_gb is None:
        return None
    return milli_of_gb(req.ext_ml_gpu_memory_gb, device_gb)


SHARING_OFF = Reason(
    "gpu_sharing",
    "vram",
    "off",
    None,
    Verdict.NEVER,
    'gpu sharing off (a job with ojs_ml_gpu_share needs a worker with ojs_ml_gpu_sharing "vram")',
)
NO_VRAM = Reason(
    "gpu.memory_gb",
    "known",
    None,
    None,
    Verdict.NEVER,
    "gpu.memory_gb unknown (a VRAM share, ojs_ml_gpu_share true, needs the worker to know "
    "its devices' VRAM: declare gpu.memory_gb, or share a fraction)",
)


def share_reasons(
    req: MLRequirements, caps: Capabilities, sharing: bool, free: Sequence[int]
) -> list[Reason]:
    """Why a share job cannot start now (WAIT) or ever (NEVER) here; [] when it fits.

    `sharing`: the worker's `ojs_ml_gpu_sharing` is on; `free`: milli left per device.
    """
    if gpu_share(req) is None:
        return []
    if not sharing:
        return [SHARING_OFF]
    milli = share_milli(req, caps)
    if milli is None:
        return [NO_VRAM]
    if pick_share(free, milli) is not None:
        return []
    best = max(free, default=0)
    template = "gpu_share free {a} < {r} milli-GPU on every device"
    return [Reason("gpu_share_milli", milli, best, FULL, Verdict.WAIT, template)]


def share_device(free: Sequence[int], milli: int, prefer: Sequence[Sequence[int]]) -> int:
    """The device a share of `milli` takes: a preferred single device with room (a warm
    child bound to it), else best fit; raises when none has room."""
    warm = [s[0] for s in prefer if len(s) == 1 and free[s[0]] >= milli]
    device = warm[0] if warm else pick_share(free, milli)
    if device is None:
        raise AllocatorError(f"no device has {milli} milli-GPU left; refusing to overcommit")
    return device


def device_free(devices: int, holders: Iterable[tuple[Sequence[int], int]]) -> tuple[int, ...]:
    """Milli left per device once each holder (its devices, milli; 0: whole) holds them."""
    free = [FULL] * devices
    for held, milli in holders:
        for i in held:
            free[i] = free[i] - milli if milli else 0
    return tuple(free)
