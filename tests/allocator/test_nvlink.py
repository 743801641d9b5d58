"""Device mapping: a job asking for `nvlink` gets GPUs that are NVLink peers.

The worker knows its links per device (`probe` through NVML's P2P status);
the allocator then picks a set of devices that are all peers of each other,
waits when no such set is free, and denies a job no such set can ever hold.
"""

from __future__ import annotations

import pytest

from celery_ojs_ml.allocator import Allocation, Denied, Pending
from celery_ojs_ml.allocator.devices import largest_peer_set, peer_sets, pick_peers
from celery_ojs_ml.testing.builders import worker_with
from tests.allocator.helpers import allocator, job, run

PAIRS = [frozenset({1}), frozenset({0}), frozenset({3}), frozenset({2})]
"""Four GPUs bridged in pairs (0-1, 2-3), as on PCIe boards with NVLink bridges."""
ISLANDS = [frozenset(range(4)) - {i} for i in range(4)] + [
    frozenset(range(4, 8)) - {i} for i in range(4, 8)
]
"""Eight GPUs in two fully linked islands of four."""


def linked(count: int) -> object:
    return job(gpu_count=count, gpu_interconnect="nvlink")


def test_peer_sets_are_the_cliques_of_the_link_graph() -> None:
    assert peer_sets(range(4), 2, PAIRS) == [(0, 1), (2, 3)]
    assert peer_sets(range(4), 3, PAIRS) == []
    assert largest_peer_set(range(8), ISLANDS) == 4
    assert largest_peer_set([0, 1, 4], ISLANDS) == 2


@pytest.mark.parametrize(
    ("free", "count", "devices"),
    [
        pytest.param(range(8), 4, (0, 1, 2, 3), id="an island whole, lowest first"),
        pytest.param([1, 2, 3, 4, 5, 6, 7], 4, (4, 5, 6, 7), id="the island that is whole"),
        pytest.param([0, 1, 2, 4, 5, 6, 7], 2, (0, 1), id="a pair from the broken island"),
        pytest.param([0, 4, 5, 6, 7], 2, (4, 5), id="no pair elsewhere: the whole island"),
        pytest.param([0, 4], 2, None, id="no two free devices are peers"),
    ],
)
def test_pick_peers_takes_a_linked_set_by_best_fit(
    free: list[int], count: int, devices: tuple[int, ...] | None
) -> None:
    assert pick_peers(free, count, ISLANDS) == devices


def test_a_2_gpu_nvlink_job_gets_a_bridged_pair_not_the_lowest_free_devices() -> None:
    a = allocator(worker_with(gpus=4, interconnect="nvlink"), nvlink_peers=PAIRS)
    run(a, "one", job(gpu_count=1))  # takes one device of a pair
    alloc = run(a, "pair", linked(2))
    assert set(alloc.devices) in ({0, 1}, {2, 3})
    assert not set(alloc.devices) & set(a.allocations()[0].devices)


def test_it_waits_while_no_linked_set_is_free_and_starts_when_one_frees() -> None:
    a = allocator(worker_with(gpus=4, interconnect="nvlink"), nvlink_peers=PAIRS)
    for name in ("a", "b", "c"):  # best fit: devices 0, 1, 2
        run(a, name, job(gpu_count=1))
    a.free("b")  # devices 1 and 3 free: two GPUs, but not peers
    assert a.free_capacity().gpus == 2
    seen = a.try_alloc("pair", "pair", linked(2))
    assert isinstance(seen, Pending)
    assert "gpu_interconnect: NVLink-peer GPUs free 1 < 2" in seen.reason
    a.free("a")  # now 0-1 is a free pair
    started = a.try_alloc("pair", "pair", linked(2))
    assert isinstance(started, Allocation) and started.devices == (0, 1)


def test_a_job_no_linked_set_can_ever_hold_is_denied_with_the_attribute_named() -> None:
    a = allocator(worker_with(gpus=4, interconnect="nvlink"), nvlink_peers=PAIRS)
    seen = a.try_alloc("four", "four", linked(4))
    assert isinstance(seen, Denied)
    assert "gpu_interconnect: NVLink-peer GPUs 2 < 4" in seen.reason


def test_without_known_links_the_usual_best_fit_applies() -> None:
    a = allocator(worker_with(gpus=4, interconnect="nvlink"))
    assert run(a, "four", linked(4)).devices == (0, 1, 2, 3)


def test_the_snapshot_reports_the_largest_set_of_free_peers_for_the_scheduler() -> None:
    """`nvlink_free` in the heartbeat: the scheduler sends an nvlink job only where that
    many free devices are peers (`WorkerState.nvlink_free`)."""
    a = allocator(worker_with(gpus=4, interconnect="nvlink"), nvlink_peers=PAIRS)
    assert a.snapshot()["nvlink_free"] == 2
    first = run(a, "one", job(gpu_count=1))  # breaks one pair
    assert a.snapshot()["nvlink_free"] == 2  # the other pair is whole
    other = [(d,) for d in range(4) if PAIRS[first.devices[0]].isdisjoint({d})]
    run(a, "other", job(gpu_count=1), prefer=[o for o in other if o != first.devices][:1])
    assert a.snapshot()["nvlink_free"] == 1  # two GPUs free, not peers
    plain = allocator(worker_with(gpus=4))
    assert "nvlink_free" not in plain.snapshot()  # links unknown: nothing reported
