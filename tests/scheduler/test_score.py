"""The placement score: FGD fragmentation, best fit, host fit and soft constraints, 0-100."""

from __future__ import annotations

from collections import Counter

import pytest

from celery_ojs_ml.matching import FreeCapacity
from celery_ojs_ml.scheduler import PendingJob, Policy, Workload, schedule, score_placement
from celery_ojs_ml.scheduler.frag import kind_of
from celery_ojs_ml.scheduler.score import normalise
from tests.scheduler.helpers import NOW, caps, decide, job, req, running, worker


def test_the_fgd_fragment_is_the_free_gpus_times_the_share_of_jobs_that_cannot_use_them() -> None:
    workload = Workload.of([1, 1, 4, 8])
    assert workload.fragment(8) == 0
    assert workload.fragment(5) == 5 * 0.25
    assert workload.fragment(3) == 3 * 0.5
    assert workload.fragment(0) == 0


def test_jobs_without_gpus_do_not_count_in_the_workload() -> None:
    assert Workload.of([0, 0, 2]).shares == ((2, 1.0),)
    assert Workload.of([]).fragment(3) == 0


@pytest.mark.parametrize(
    ("value", "low", "high", "expected"),
    [(5, 0, 10, 50.0), (-1, 0, 10, 0.0), (11, 0, 10, 100.0), (3, 3, 3, 100.0)],
)
def test_scores_are_normalised_to_0_100_and_clipped(
    value: float, low: float, high: float, expected: float
) -> None:
    assert normalise(value, low, high) == expected


def test_a_placement_that_leaves_no_gpu_idle_packs_best() -> None:
    workload = Workload.of([1])
    full = score_placement(
        req(gpu_count=1), caps("nvidia-l4x1"), FreeCapacity(gpus=1), workload=workload
    )
    roomy = score_placement(
        req(gpu_count=1), caps("nvidia-a100x8"), FreeCapacity(gpus=8), workload=workload
    )
    assert full.gpu_fit == 100.0 and roomy.gpu_fit == 12.5
    assert full.total > roomy.total
    assert 0 <= roomy.total <= full.total <= 100


def test_spread_turns_the_gpu_terms_around() -> None:
    workload = Workload.of([1])
    full = score_placement(
        req(gpu_count=1),
        caps("nvidia-l4x1"),
        FreeCapacity(gpus=1),
        workload=workload,
        gpu_affinity="spread",
    )
    roomy = score_placement(
        req(gpu_count=1),
        caps("nvidia-a100x8"),
        FreeCapacity(gpus=8),
        workload=workload,
        gpu_affinity="spread",
    )
    assert roomy.total > full.total


def test_the_affinity_part_is_matchings_soft_score_weighted_by_the_policy() -> None:
    prefers = {
        "preferred": [{"key": "gpu_type", "operator": "In", "values": ["nvidia-l4"], "weight": 10}]
    }
    scored = score_placement(
        req(gpu_count=1, affinity=prefers),
        caps("nvidia-l4x1"),
        FreeCapacity(gpus=1),
        workload=Workload.of([1]),
        policy=Policy(affinity_weight=1.0),
    )
    assert (scored.affinity, scored.total) == (100.0, 100.0)


def test_the_assignment_carries_the_same_score_explain_computes() -> None:
    fleet = [worker("l4", "nvidia-l4x1")]
    pending = [job("j", gpu_count=1)]
    decision = decide(pending, fleet)
    expected = score_placement(
        pending[0].req, fleet[0].caps, fleet[0].free, workload=Workload.of([1], largest=1)
    )
    assert decision.assignments[0].score == expected.total


def test_the_workload_counts_every_pending_job_whether_or_not_they_share_requirements() -> None:
    """The pass groups pending jobs by their requirements object (the admission parses
    identical declarations into one) to weigh fragmentation by kind: jobs sharing one
    object count once each, exactly as jobs holding equal copies."""
    sizes = [1, 1, 1, 2, 4, 1, 2, 8, 1, 1]
    shared = {n: req(gpu_count=n) for n in set(sizes)}
    one = [PendingJob(f"j{i}", shared[n], submitted_at=float(i)) for i, n in enumerate(sizes)]
    copies = [
        PendingJob(f"j{i}", shared[n].model_copy(), submitted_at=float(i))
        for i, n in enumerate(sizes)
    ]
    busy = [running(f"r{i}", gpu_count=1) for i in range(3)]
    fleet = [worker("a", jobs=busy), worker("b", "nvidia-a100x2"), worker("c", "nvidia-l40sx4")]
    assert schedule(one, fleet, NOW) == schedule(copies, fleet, NOW)
    counted = Workload.of_counts(Counter(kind_of(j) for j in copies), 8)
    assert counted == Workload.of_kinds((kind_of(j) for j in copies), 8)
    assert dict(counted.shares) == {1: 0.6, 2: 0.2, 4: 0.1, 8: 0.1}
