"""`Policy.queue_depth` (`ojs_ml_queue_depth`): a pass that decides only the first jobs.

The live leader runs such passes between full ones (Slurm's default_queue_depth);
`test_state_machine.FleetMachine.quick_pass_agrees` checks on random fleets that
the jobs decided get exactly the full pass's decisions.
"""

from __future__ import annotations

from celery_ojs_ml.scheduler import Decision, PendingJob, Policy, schedule
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


# -- `Policy.settle`: a quick pass stops where every job left can only wait --------------------


def _backlog(n: int) -> list[PendingJob]:
    return [job(f"j{i}", at=i, gpu_count=1, limit=60) for i in range(n)]


def _same(a: Decision, b: Decision) -> None:
    for name in ("assignments", "reservations", "preemptions", "denials"):
        assert set(getattr(a, name)) == set(getattr(b, name)), name


def test_a_settled_pass_stops_once_the_fleet_is_full_and_the_reservation_is_taken() -> None:
    """Two GPUs free, 50 jobs waiting: the pass starts two, reserves for the third and
    leaves the other 47 as they were (not decided, not annotated); the full pass
    gives them nothing but a waiting annotation."""
    busy = [running(f"r{i}", gpu_count=1, limit=60) for i in range(6)]
    fleet = [worker("w", jobs=busy)]
    pending = _backlog(50)
    quick = schedule(pending, fleet, NOW, Policy(queue_depth=100, settle=True))
    full = schedule(pending, fleet, NOW, Policy())
    _same(quick, full)
    assert [a.task_id for a in quick.assignments] == ["j0", "j1"]
    assert [r.task_id for r in quick.reservations] == ["j2"]
    assert set(quick.annotations) == {"j2"}, "only the reserved job is annotated"
    assert len(full.annotations) == 48


def test_a_settled_pass_goes_on_while_a_job_could_preempt() -> None:
    """A spot job runs on the full fleet and on-demand jobs wait, with no reservation
    to take (depth 0): the first may preempt it, so the pass does not stop there."""
    busy = [running(f"r{i}", gpu_count=1, limit=60) for i in range(7)]
    busy.append(running("spot", gpu_count=1, band="spot", preemptible=True))
    fleet = [worker("w", jobs=busy)]
    quick = schedule(_backlog(3), fleet, NOW, Policy(queue_depth=100, settle=True,
                                                     reservation_depth=0))  # fmt: skip
    full = schedule(_backlog(3), fleet, NOW, Policy(reservation_depth=0))
    _same(quick, full)
    assert [p.task_id for p in quick.preemptions] == ["j0"]


def test_a_settled_pass_goes_on_for_a_job_that_needs_no_whole_gpu() -> None:
    """A CPU-only job can start on a worker with no free GPU: no early stop."""
    busy = [running(f"r{i}", gpu_count=1, limit=60) for i in range(8)]
    fleet = [worker("w", jobs=busy)]
    pending = [*_backlog(3), job("cpu", at=9, cpu_cores=1)]
    quick = schedule(pending, fleet, NOW, Policy(queue_depth=100, settle=True))
    full = schedule(pending, fleet, NOW, Policy())
    _same(quick, full)
    assert [a.task_id for a in quick.assignments] == ["cpu"]
