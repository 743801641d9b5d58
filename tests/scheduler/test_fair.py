"""Fair sharing between queues (`ojs_ml_fair_share`, `scheduler.fair`): weighted max-min."""

from __future__ import annotations

from celery_ojs_ml.scheduler import Decision, PendingJob, Policy, schedule
from celery_ojs_ml.scheduler.fair import AheadShares, weighted_split
from tests.scheduler.helpers import NOW, job, running, worker


def _queues(decision: Decision, pending: list[PendingJob]) -> dict[str, int]:
    by_id = {j.task_id: j.queue for j in pending}
    out: dict[str, int] = {}
    for a in decision.assignments:
        out[by_id[a.task_id]] = out.get(by_id[a.task_id], 0) + 1
    return out


def test_competing_queues_share_gpus_in_proportion_to_their_weights() -> None:
    """8 GPUs, weights 3:1, both queues with more work than GPUs: 6 and 2."""
    both = frozenset({"train", "infer"})
    pending = [job(f"t{i}", at=i, gpu_count=1, queue="train") for i in range(10)]
    pending += [job(f"i{i}", at=100 + i, gpu_count=1, queue="infer") for i in range(10)]
    weights = (("train", 3.0), ("infer", 1.0))
    decision = schedule(pending, [worker("w", queues=both)], NOW, Policy(weights=weights))
    assert _queues(decision, pending) == {"train": 6, "infer": 2}


def test_without_weights_the_earlier_queue_takes_every_gpu() -> None:
    both = frozenset({"train", "infer"})
    pending = [job(f"t{i}", at=i, gpu_count=1, queue="train") for i in range(10)]
    pending += [job(f"i{i}", at=100 + i, gpu_count=1, queue="infer") for i in range(10)]
    decision = schedule(pending, [worker("w", queues=both)], NOW, Policy())
    assert _queues(decision, pending) == {"train": 8}


def test_what_a_queue_already_holds_counts_against_its_share() -> None:
    both = frozenset({"train", "infer"})
    held = [running(f"r{i}", gpu_count=1, queue="train", limit=60) for i in range(4)]
    pending = [job(f"t{i}", at=i, gpu_count=1, queue="train") for i in range(4)]
    pending += [job(f"i{i}", at=100 + i, gpu_count=1, queue="infer") for i in range(4)]
    weights = (("train", 1.0), ("infer", 1.0))
    decision = schedule(
        pending, [worker("w", queues=both, jobs=held)], NOW, Policy(weights=weights)
    )
    assert _queues(decision, pending) == {"infer": 4}


def test_assignments_not_yet_running_count_against_their_queues_share() -> None:
    """A pass between an assignment and its lease must see the assigned GPUs held.

    8 GPUs, train runs 4, infer has 2 in flight (assigned, no lease yet), weights
    3:1: infer already holds 2 (share 2.0 against train's 1.33), so train gets 3
    of the 4 free GPUs. Counting only leases would give infer 2 more."""
    both = frozenset({"train", "infer"})
    held = [running(f"r{i}", gpu_count=1, queue="train", limit=60) for i in range(4)]
    pending = [job(f"t{i}", at=i, gpu_count=1, queue="train") for i in range(6)]
    pending += [job(f"i{i}", at=100 + i, gpu_count=1, queue="infer") for i in range(6)]
    weights = (("train", 3.0), ("infer", 1.0))
    fleet = [worker("w", queues=both, jobs=held)]
    policy = Policy(weights=weights)
    seen = schedule(pending, fleet, NOW, policy, inflight=[("infer", 1), ("infer", 1)])
    assert _queues(seen, pending) == {"train": 3, "infer": 1}
    blind = schedule(pending, fleet, NOW, policy)
    assert _queues(blind, pending) == {"train": 2, "infer": 2}


def test_a_queue_asking_for_less_than_its_share_leaves_the_rest_to_the_others() -> None:
    both = frozenset({"train", "infer"})
    pending = [job(f"t{i}", at=i, gpu_count=1, queue="train") for i in range(10)]
    pending += [job("i0", at=100, gpu_count=1, queue="infer")]
    weights = (("train", 1.0), ("infer", 1.0))
    decision = schedule(pending, [worker("w", queues=both)], NOW, Policy(weights=weights))
    assert _queues(decision, pending) == {"train": 7, "infer": 1}


def test_fairness_never_reorders_bands() -> None:
    both = frozenset({"train", "infer"})
    pending = [job(f"t{i}", at=i, gpu_count=1, queue="train", priority_class="reserved")
               for i in range(8)]  # fmt: skip
    pending += [job(f"i{i}", at=i, gpu_count=1, queue="infer") for i in range(8)]
    weights = (("train", 1.0), ("infer", 100.0))
    decision = schedule(pending, [worker("w", queues=both)], NOW, Policy(weights=weights))
    assert _queues(decision, pending) == {"train": 8}


def test_the_weighted_split_gives_each_queue_its_weights_part() -> None:
    split = weighted_split(4, {"train": 12, "infer": 12}, {"train": 3, "infer": 1})
    assert split == {"train": 3.0, "infer": 1.0}


def test_a_queue_that_asks_for_less_leaves_the_rest_to_the_others() -> None:
    split = weighted_split(8, {"train": 12, "infer": 1, "idle": 0}, {"infer": 3})
    assert split == {"train": 7.0, "infer": 1.0, "idle": 0.0}


def _shares(held: dict[str, int], on: set[str], ahead: dict[str, int] | None = None) -> AheadShares:
    weights = {"train": 3.0, "infer": 1.0}
    split = weighted_split(4, {"train": 12, "infer": 12}, weights)
    waiting = {"train": 8, "infer": 8}  # both queues have jobs waiting
    return AheadShares(split, held, ahead or {}, {"w": on}, waiting)


def test_a_job_may_wait_ahead_only_where_its_start_keeps_its_queue_within_its_share() -> None:
    """4 GPUs, weights 3:1, both queues loaded: shares 3 and 1 (prefetch, `AheadShares`)."""
    infer, train = job("i", gpu_count=1, queue="infer"), job("t", gpu_count=1, queue="train")
    # Both at their share on a worker running both: the next end may be either queue's,
    # so a job started there ahead of a pass could take the other queue's GPU.
    mixed = _shares({"train": 3, "infer": 1}, {"train", "infer"})
    assert not mixed.admits(infer, "w") and not mixed.admits(train, "w")
    # Below its share it may, once: counted, the second would pass the share.
    below = _shares({"train": 2, "infer": 1}, {"train", "infer"})
    assert below.admits(train, "w")
    below.take(train, "w")
    assert not below.admits(train, "w")
    # Where every job is of its own queue it takes the place of one of them.
    alone = _shares({"train": 3, "infer": 0}, {"train"})
    assert alone.admits(train, "w")
    alone.take(train, "w")
    assert alone.admits(train, "w")
    # ...unless the queue is past its share already: a pass hands the GPU out fairly.
    over = _shares({"train": 4, "infer": 0}, {"train"})
    assert not over.admits(train, "w") and over.admits(infer, "w")


def test_with_no_other_queue_waiting_a_job_may_wait_ahead_past_its_share() -> None:
    """Work-conserving: only a queue with jobs waiting can lose a GPU to a start."""
    train = job("t", gpu_count=1, queue="train")
    split = weighted_split(4, {"train": 12, "infer": 1}, {"train": 1.0, "infer": 3.0})
    alone = AheadShares(split, {"train": 3, "infer": 1}, {}, {"w": {"train", "infer"}})
    assert alone.admits(train, "w")
    waits = AheadShares(
        split, {"train": 3, "infer": 1}, {}, {"w": {"train", "infer"}}, {"infer": 1}
    )
    assert not waits.admits(train, "w")
