"""`Policy.queue_depth` (`ojs_ml_queue_depth`): a pass that decides only the first jobs.

The live leader runs such passes between full ones (Slurm's default_queue_depth);
`test_state_machine.FleetMachine.quick_pass_agrees` checks on random fleets that
the jobs decided get exactly the full pass's decisions.
"""

from __future__ import annotations

from celery_ojs_ml.scheduler import Policy, schedule
from tests.scheduler.helpers import NOW, job, running, worker


def test_a_pass_decides_only_the_first_jobs_in_order() -> None:
    pending = [job(f"j{i}", at=i, gpu_count=1) for i in range(10)]
    decision = schedule(pending, [worker("w")], NOW, Policy(queue_depth=3))
    assert [a.task_id for a in decision.assignments] == ["j0", "j1", "j2"]
    assert not decision.annotations, "jobs past the depth keep their earlier annotations"
    full = schedule(pending, [worker("w")], NOW, Policy())
    assert len(full.assignments) == 8


def test_the_depth_counts_in_fair_order_so_a_later_queue_is_not_starved() -> None:
    """Cut after the fair order: a queue whose jobs all come later in fleet order still
    gets its share in a shallow pass."""
    both = frozenset({"train", "infer"})
    pending = [job(f"t{i}", at=i, gpu_count=1, queue="train") for i in range(10)]
    pending += [job(f"i{i}", at=100 + i, gpu_count=1, queue="infer") for i in range(10)]
    policy = Policy(weights=(("train", 1.0), ("infer", 1.0)), queue_depth=4)
    decision = schedule(pending, [worker("w", queues=both)], NOW, policy)
    queues = sorted(a.task_id[0] for a in decision.assignments)
    assert queues == ["i", "i", "t", "t"]


def test_a_blocked_job_within_the_depth_still_reserves_against_later_ones() -> None:
    """The 8-GPU job first in order reserves the worker; the 1-GPU job after it,
    within the depth, may not take the capacity it waits for (backfill rule)."""
    busy = [running(f"r{i}", gpu_count=1, limit=60) for i in range(4)]
    pending = [job("big", at=0, gpu_count=8), job("small", at=1, gpu_count=1)]
    decision = schedule(pending, [worker("w", jobs=busy)], NOW, Policy(queue_depth=2))
    assert [r.task_id for r in decision.reservations] == ["big"]
    assert not decision.assignments
