"""Rule 2, no starvation: reserve for the first blocked jobs, let shorter jobs backfill.

When a job first in order fits nowhere now, the worker where it can start
soonest (by the time limits of the jobs running there) is reserved for it. A
job behind it may start on that worker only if doing so leaves the
reservation its capacity: it ends before the reserved start, or it uses what
the reserved job does not need. A job with no time limit never takes
reserved capacity. (DESIGN invariant 7, Slurm's backfill.)
"""

from __future__ import annotations

import random
from dataclasses import replace

from celery_ojs_ml.scheduler import Policy, Reservation, WorkerState
from tests.scheduler.helpers import NOW, caps, decide, job, running, worker
from tests.scheduler.sim import Sim, SimWorker


def _four_gpu_worker_busy_for(*limits: float) -> list[WorkerState]:
    """A 4-GPU worker running one 1-GPU job per limit, all started now."""
    jobs = [running(f"r{i}", started=NOW, limit=t, gpu_count=1) for i, t in enumerate(limits)]
    return [worker("w4", "nvidia-a100x4", jobs)]


def test_the_first_blocked_job_reserves_the_worker_where_it_can_start_soonest() -> None:
    fleet = [
        worker("late", jobs=[running("a", started=NOW, limit=900, gpu_count=6)]),
        worker("soon", jobs=[running("b", started=NOW, limit=300, gpu_count=6)]),
    ]
    decision = decide([job("big", gpu_count=4, limit=3600)], fleet)
    assert decision.reservations == (Reservation("big", "soon", NOW + 300),)
    assert decision.annotations["big"].t_estimate == NOW + 300


def test_a_job_that_ends_before_the_reserved_start_backfills() -> None:
    fleet = _four_gpu_worker_busy_for(100, 200, 300)
    decision = decide(
        [job("big", at=1, gpu_count=4, limit=600), job("short", at=2, gpu_count=1, limit=250)],
        fleet,
    )
    assert decision.reservations == (Reservation("big", "w4", NOW + 300),)
    assert decision.assigned() == {"short": "w4"}


def test_a_job_that_would_end_after_the_reserved_start_does_not_backfill() -> None:
    fleet = _four_gpu_worker_busy_for(100, 200, 300)
    decision = decide(
        [job("big", at=1, gpu_count=4, limit=600), job("long", at=2, gpu_count=1, limit=301)],
        fleet,
    )
    assert decision.assigned() == {}
    assert decision.annotations["long"].reason_pending == "1/1 workers eligible: 1 reserved for big"


def test_a_job_without_a_time_limit_never_backfills_onto_reserved_capacity() -> None:
    fleet = _four_gpu_worker_busy_for(100, 200, 300)
    decision = decide(
        [job("big", at=1, gpu_count=4, limit=600), job("open", at=2, gpu_count=1)], fleet
    )
    assert decision.assigned() == {}
    assert decision.annotations["open"].t_estimate == NOW + 300 + 600


def test_capacity_the_reservation_does_not_need_stays_usable_by_any_job() -> None:
    fleet = [worker("w8", jobs=[running("a", started=NOW, limit=300, gpu_count=6)])]
    decision = decide(
        [job("big", at=1, gpu_count=4, limit=600), job("open", at=2, gpu_count=2)], fleet
    )
    assert decision.reservations == (Reservation("big", "w8", NOW + 300),)
    assert decision.assigned() == {"open": "w8"}


def test_a_higher_band_job_is_not_held_back_by_a_lower_band_reservation() -> None:
    fleet = _four_gpu_worker_busy_for(100, 200, 300)
    decision = decide(
        [
            job("spot-big", at=1, gpu_count=4, limit=600, priority_class="spot"),
            job("res-small", at=2, gpu_count=1, limit=50, priority_class="reserved"),
        ],
        fleet,
    )
    assert decision.assigned() == {"res-small": "w4"}
    assert decision.reservations == (Reservation("spot-big", "w4", NOW + 300),)


def test_reservation_depth_two_reserves_for_the_first_two_blocked_jobs() -> None:
    fleet = [
        worker("a", jobs=[running("x", started=NOW, limit=100, gpu_count=8)]),
        worker("b", jobs=[running("y", started=NOW, limit=200, gpu_count=8)]),
    ]
    pending = [job(f"big{i}", at=i, gpu_count=8, limit=1000) for i in range(3)]
    decision = decide(pending, fleet, reservation_depth=2)
    assert decision.reservations == (
        Reservation("big0", "a", NOW + 100),
        Reservation("big1", "b", NOW + 200),
    )
    assert decision.annotations["big2"].t_estimate == NOW + 1100


def test_with_no_known_end_the_reservation_holds_the_worker_that_lacks_least() -> None:
    fleet = [
        worker("lacks-4", jobs=[running("x", gpu_count=4)]),
        worker("lacks-2", jobs=[running("y", gpu_count=2)]),
    ]
    decision = decide([job("big", at=1, gpu_count=8), job("small", at=2, gpu_count=1)], fleet)
    assert decision.reservations == (Reservation("big", "lacks-2", None),)
    assert decision.annotations["big"].t_estimate is None
    assert decision.assigned() == {"small": "lacks-4"}


def test_a_4_gpu_job_under_a_stream_of_1_gpu_jobs_starts_within_two_small_time_limits() -> None:
    """The starvation scenario, replayed on the pure core.

    Eight 1-GPU jobs stay in flight on one 4-GPU worker (four run, four wait),
    each with a 1.5 s time limit. When the 4-GPU job arrives, the four small jobs
    already waiting are ahead of it (same band, earlier): they start within one
    time limit; from then on the big job is first in order and its reservation
    frees within one more. Bound: 2 x 1.5 s plus one 0.1 s scheduling step.
    """
    rng = random.Random(4)
    sim = Sim(policy=Policy())
    sim.workers["w4"] = SimWorker(caps("nvidia-a100x4"))
    n = 0
    for _ in range(200):
        while sum(1 for t in sim.pending if t.startswith("s")) < 4:
            sim.submit(job(f"s{n}", gpu_count=1, limit=1.5), rng.uniform(0.5, 1.5))
            n += 1
        if sim.now >= 1.0 and "big" not in sim.jobs:
            sim.submit(job("big", gpu_count=4, limit=5), 2.0)
        sim.step()
        if "big" in sim.started:
            break
        sim.advance(0.1)
    assert sim.started["big"] - sim.jobs["big"].submitted_at <= 2 * 1.5 + 0.1 + 1e-9


def test_a_job_sitting_out_a_give_back_keeps_its_place_and_its_reservation() -> None:
    """A 4-GPU job given back by a gate (its view was stale) sits out a back-off. Meanwhile
    it is still first in order and holds the free GPUs it waits for: the 1-GPU jobs
    behind it, which would end after it can start again, do not take them."""
    fleet = [worker("w4", "nvidia-a100x4")]
    big = replace(job("big", at=1, gpu_count=4, limit=60), not_before=NOW + 0.5)
    small = [job(f"s{i}", at=2 + i, gpu_count=1, limit=2) for i in range(4)]
    decision = decide([big, *small], fleet)
    assert decision.assignments == ()
    assert [(r.task_id, r.worker) for r in decision.reservations] == [("big", "w4")]
    after = decide([replace(big, not_before=NOW - 0.1), *small], fleet)
    assert [(a.task_id, a.worker) for a in after.assignments] == [("big", "w4")]


def test_a_job_sitting_out_a_give_back_lets_only_what_ends_in_time_backfill() -> None:
    fleet = [worker("w4", "nvidia-a100x4")]
    big = replace(job("big", at=1, gpu_count=4, limit=60), not_before=NOW + 0.5)
    decision = decide([big, job("unlimited", at=2, gpu_count=1)], fleet)
    assert decision.assignments == (), "no time limit: never on reserved capacity"
    three = replace(job("three", at=1, gpu_count=3, limit=60), not_before=NOW + 0.5)
    decision = decide([three, job("other", at=2, gpu_count=1)], fleet)
    assert [a.task_id for a in decision.assignments] == ["other"], "what it does not need"


def test_a_job_just_past_its_limit_is_expected_to_end_soon_so_nothing_backfills_behind_it() -> None:
    """A running job whose limit ran out 50 ms ago is being killed (the limit is a hard
    one) or its lease's start preceded its body's: it is expected to end `overdue_s` (1 s)
    from now. The reserved start is then 1 s away, and a 2 s job behind the reservation
    does not backfill onto the three free GPUs. With the old 10 s guess it did, and the
    4-GPU job waited for it (the live starvation test, about 1 run in 20)."""
    fleet = [
        worker("w4", "nvidia-a100x4", [running("r", started=NOW - 2.05, limit=2, gpu_count=1)])
    ]
    pending = [job("big", at=1, gpu_count=4, limit=60), job("small", at=2, gpu_count=1, limit=2)]
    decision = decide(pending, fleet)
    assert decision.reservations == (Reservation("big", "w4", NOW + 1),)
    assert decision.assigned() == {}, "the 2 s job would end after the reserved start"
    assert decide(pending, fleet, overdue_s=10).assigned() == {"small": "w4"}, "the old guess"
