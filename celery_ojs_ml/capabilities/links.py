"""NVLink peer sets: which devices of a worker are all linked to each other.

Pure: the probe (`probe.py`) reads each device's peers from NVML; the
allocator picks a job's devices among them (`allocator.devices.pick_peers`).
A peer set is a clique of the link graph: on an NVSwitch board every device,
on PCIe boards with NVLink bridges the bridged pairs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Peers = Sequence[frozenset[int]]
"""NVLink peers of each device: `peers[i]` holds the indices device i reaches over NVLink."""

_EXACT_UP_TO = 16
"""Free devices up to which `pick_peers` searches every peer set; above, it grows greedily."""


def peer_sets(free: Iterable[int], count: int, peers: Peers) -> list[tuple[int, ...]]:
    """Every set of `count` devices out of `free` that are NVLink peers of each other."""
    pool = sorted(i for i in set(free) if 0 <= i < len(peers))
    if count <= 1:
        return [(i,) for i in pool] if count == 1 else []
    if len(pool) > _EXACT_UP_TO:
        return _greedy_sets(pool, count, peers)
    out: list[tuple[int, ...]] = []

    def grow(chosen: tuple[int, ...], rest: list[int]) -> None:
        if len(chosen) == count:
            out.append(chosen)
            return
        for n, i in enumerate(rest):
            if all(i in peers[c] for c in chosen):
                grow((*chosen, i), rest[n + 1 :])

    grow((), pool)
    return out


def _greedy_sets(pool: list[int], count: int, peers: Peers) -> list[tuple[int, ...]]:
    out = []
    for start in pool:
        chosen = [start]
        for i in pool:
            if i not in chosen and all(i in peers[c] for c in chosen):
                chosen.append(i)
                if len(chosen) == count:
                    out.append(tuple(sorted(chosen)))
                    break
    return sorted(set(out))


def largest_peer_set(devices: Iterable[int], peers: Peers) -> int:
    """The most devices of `devices` that are all NVLink peers of each other."""
    pool = sorted(set(devices))
    best = min(len(pool), 1)
    for size in range(2, len(pool) + 1):
        if not peer_sets(pool, size, peers):
            break
        best = size
    return best
