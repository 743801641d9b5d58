"""Which GPU indices a job gets: best fit over runs of contiguous free devices.

Key decision: device indices that are next to each other usually share an
NVLink/NVSwitch island or a PCIe switch, so a job should take its GPUs from the
*smallest* run of contiguous free indices that can hold it (lowest start on a
tie). That leaves the long runs whole for the multi-GPU jobs that need them.
When no single run is long enough, the job takes the lowest free indices.

A job that asks for `nvlink` between its GPUs takes devices that NVML reports
as NVLink peers of each other (`pick_peers`), when the worker knows them.
"""

from __future__ import annotations

from collections.abc import Iterable

from celery_ojs_ml.capabilities.links import Peers, largest_peer_set, peer_sets


def free_runs(free: Iterable[int]) -> list[list[int]]:
    """Maximal runs of consecutive indices, in index order: [0, 1, 3] -> [[0, 1], [3]]."""
    runs: list[list[int]] = []
    for index in sorted(free):
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def pick_devices(free: Iterable[int], count: int) -> tuple[int, ...]:
    """`count` indices out of `free` by best fit (see module doc); () for count 0."""
    if count <= 0:
        return ()
    runs = free_runs(free)
    if sum(len(r) for r in runs) < count:
        raise ValueError(f"{count} devices requested but only {sum(map(len, runs))} free")
    fitting = [r for r in runs if len(r) >= count]
    if fitting:
        best = min(fitting, key=lambda r: (len(r), r[0]))
        return tuple(best[:count])
    return tuple(sorted(i for r in runs for i in r)[:count])


def pick_peers(free: Iterable[int], count: int, peers: Peers) -> tuple[int, ...] | None:
    """`count` free devices that are all NVLink peers, by best fit; None when none are free.

    Best fit as for runs: the set whose devices have the fewest free peers
    outside it (it breaks up the smallest free island), lowest indices on a tie.
    """
    free = set(free)
    found = peer_sets(free, count, peers)
    if not found:
        return None

    def spill(s: tuple[int, ...]) -> int:
        return len({p for i in s for p in peers[i] if p in free} - set(s))

    return min(found, key=lambda s: (spill(s), s))


__all__ = ["Peers", "free_runs", "largest_peer_set", "peer_sets", "pick_devices", "pick_peers"]
