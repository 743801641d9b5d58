"""The warm-children slot format: the worker's main process and its pool children share it.

Key decision: a pool child's binding (the device set its CUDA came up with) is one
signed 64-bit word in shared memory, indexed by the child's billiard process
index, so the main process reads it without a message: 0 is unbound, `TAINTED`
is CUDA initialised without an allocation, anything else is a device mask with
bit 62 set (so a bound set is never 0).
"""

from __future__ import annotations

from collections.abc import Iterable

SLOTS = 4096
"""Pool process indices the table covers (autoscaled pools index from 0 up)."""
TAINTED = -1
"""Slot value of a child whose CUDA was initialised with no allocation (all devices)."""


def mask_of(devices: Iterable[int]) -> int:
    """A device set as a bit mask (bit 62 marks 'bound', so a set is never 0)."""
    mask = 1 << 62
    for d in devices:
        if not 0 <= int(d) < 62:
            raise ValueError(f"device index {d} outside 0-61")
        mask |= 1 << int(d)
    return mask


def devices_of_mask(mask: int) -> list[int]:
    """The device indices of a `mask_of` mask."""
    return [i for i in range(62) if mask >> i & 1]
