"""`bench/replay_fgd.py`: the FGD artifact's methodology, checked on tiny clusters."""

from __future__ import annotations

import random

from bench.replay_fgd import (
    LOADS,
    TUNE,
    Chooser,
    Cluster,
    bestfit_policy,
    placements,
    project_policy,
    random_policy,
    run,
    workload,
    workload_of,
)
from bench.trace import Node, Pod

NODES = [Node(f"n{i}", 64000, 262144, 2, "T4") for i in range(3)] + [
    Node("v", 96000, 262144, 8, "V100M32")
]
CAPACITY = sum(n.gpus for n in NODES) * 1000


def final(pods: list[Pod], choose: Chooser, rank: list[int] | None = None) -> float:
    """The allocation rate (%) once every pod was tried."""
    return list(placements(NODES, pods, choose, rank or list(range(len(NODES)))))[-1][1]


def pod(name: str, gpus: int = 1, milli: int = 1000, spec: str = "", cpu: int = 4000) -> Pod:
    return Pod(name, cpu, 8192, gpus, milli if gpus else 0, frozenset(s for s in [spec] if s))


def test_tuning_appends_drawn_pods_after_every_trace_pod_until_130_percent() -> None:
    pods = [pod(f"p{i}", milli=500) for i in range(8)]  # 4,000 milli of 14,000
    out = workload(pods, CAPACITY, random.Random(1), "shuffle")
    assert sorted(p.name for p in out[:8]) == sorted(p.name for p in pods)  # each once, first
    total = sum(p.gpu_total for p in out)
    assert total <= TUNE * CAPACITY < total + 500  # stops before the next would pass it


def test_above_130_percent_pods_are_removed_at_random_in_order() -> None:
    pods = [pod(f"p{i}", gpus=2) for i in range(20)]  # 40,000 milli: 286%
    out = workload(pods, CAPACITY, random.Random(2), "creation")
    assert sum(p.gpu_total for p in out) <= TUNE * CAPACITY
    names = [p.name for p in out]
    assert names == sorted(names, key=lambda n: int(n[1:]))  # order kept


def test_a_pod_that_fits_nowhere_fails_and_later_pods_still_place() -> None:
    pods = [pod("big", gpus=16), pod("small")]
    rates = run(NODES, pods, bestfit_policy, list(range(len(NODES))))
    assert set(rates) == {str(load) for load in LOADS}
    assert final(pods, bestfit_policy) == 100 * 1000 / CAPACITY  # only the small one


def test_shares_never_oversubscribe_and_whole_pods_take_only_untouched_gpus() -> None:
    rng = random.Random(3)
    pods = [pod(f"s{i}", milli=rng.choice([150, 300, 470, 810])) for i in range(60)]
    pods += [pod(f"w{i}", gpus=rng.choice([1, 2])) for i in range(10)]
    for choose in (random_policy(rng), bestfit_policy, project_policy(workload_of(pods, NODES))):
        cluster = Cluster(NODES, list(range(len(NODES))))
        for p in pods:
            kid = hash(p.kind)
            options = cluster.options(p.kind, kid)
            if options:
                group, devices = choose(cluster, p.kind, kid, options)
                gpus = group.state[3]
                assert all(gpus[i] >= p.gpu_milli for i in devices)
                if p.gpu_milli >= 1000:
                    assert all(gpus[i] == 1000 for i in devices)
                cluster.take(group, p.kind, devices)
        for group in cluster.groups.values():
            assert all(0 <= left <= 1000 for left in group.state[3])
        assert cluster.allocated <= cluster.capacity


def test_gpu_spec_restricts_the_gpu_model() -> None:
    pods = [pod(f"v{i}", spec="V100M32") for i in range(10)]  # only 8 V100 GPUs
    assert final(pods, bestfit_policy) == 100 * 8000 / CAPACITY


def test_the_project_policy_keeps_a_whole_node_for_the_8_gpu_pod() -> None:
    """FGD through `placement`: the 1-GPU pods fill the 2-GPU nodes, so the 8-GPU pod fits;
    random placement would often break the 8-GPU node first."""
    pods = [pod(f"o{i}") for i in range(6)] + [pod("eight", gpus=8)]
    choose = project_policy(workload_of(pods, NODES))
    for rank in ([0, 1, 2, 3], [3, 2, 1, 0]):
        assert final(pods, choose, rank) == 100.0
