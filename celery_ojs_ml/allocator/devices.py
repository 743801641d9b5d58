"""Which GPU indices a job gets: best fit over runs of contiguous free devices.

Key decision: device indices that are next to each other usually share an
NVLink/NVSwitch island or a PCIe switch, so a job should take its GPUs from the
*smallest* run of contiguous free indices that can hold it (lowest start on a
tie). That leaves the long runs whole for the multi-GPU jobs that need them.
When no single run is long enough, the job takes the lowest free indices.
"""

from __future__ import annotations

from collections.abc import Iterable


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
