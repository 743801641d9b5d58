"""Dynamic reservations in the fleet pass (OJS ML §8.3, `scheduler.pools`).

§8.3: a job naming a reservation MUST NOT be dispatched to a worker outside
the reserved capacity pool; nothing else uses that capacity while it is held.
"""

from __future__ import annotations

from celery_ojs_ml.scheduler import Policy, ReservationPool, schedule
from tests.scheduler.helpers import NOW, job, req, running, worker


def pool(rid: str, worker_name: str | None = None, **attrs: object) -> ReservationPool:
    return ReservationPool(rid, req(**attrs), NOW - 10, worker_name, NOW + 3600)


def test_a_reservation_waiting_to_be_placed_is_placed_like_a_job_on_the_best_fit() -> None:
    fleet = [worker("big"), worker("small", "nvidia-l4x1")]
    decision = schedule([], fleet, NOW, Policy(), pools=[pool("r1", gpu_count=1)])
    assert [(a.task_id, a.worker) for a in decision.assignments] == [("reservation:r1", "small")]


def test_a_job_of_a_placed_reservation_runs_only_on_its_worker() -> None:
    """§8.3 MUST NOT dispatch outside the pool, though the other worker is idle."""
    fleet = [worker("a"), worker("b")]
    pools = [pool("r1", "b", gpu_count=2)]
    pending = [job("in1", gpu_count=2, reservation_id="r1")]
    decision = schedule(pending, fleet, NOW, Policy(), pools=pools)
    assert decision.assigned() == {"in1": "b"}


def test_no_other_job_uses_a_placed_reservations_capacity() -> None:
    """§8.3: 8 GPUs, 6 reserved: only 2 outside 1-GPU jobs start."""
    fleet = [worker("a")]
    pools = [pool("r1", "a", gpu_count=6)]
    pending = [job(f"o{i}", at=i, gpu_count=1) for i in range(4)]
    decision = schedule(pending, fleet, NOW, Policy(), pools=pools)
    assert sorted(decision.assigned()) == ["o0", "o1"]


def test_a_gate_that_holds_the_reservation_is_not_charged_twice() -> None:
    held = ReservationPool("r1", req(gpu_count=6), NOW - 10, "a", NOW + 3600, held=True)
    fleet = [worker("a", jobs=[running("fill", gpu_count=6, limit=60)])]  # the gate's free: 2
    pending = [job(f"o{i}", at=i, gpu_count=1) for i in range(4)]
    decision = schedule(pending, fleet, NOW, Policy(), pools=[held])
    assert sorted(decision.assigned()) == ["o0", "o1"]


def test_jobs_inside_a_reservation_start_in_any_order_their_requirements_fit() -> None:
    fleet = [worker("a", jobs=[running("in0", gpu_count=1, reservation_id="r1", limit=60)])]
    pools = [pool("r1", "a", gpu_count=4)]
    pending = [
        job("big", at=1, gpu_count=4, reservation_id="r1"),
        job("small", at=2, gpu_count=2, reservation_id="r1"),
    ]
    decision = schedule(pending, fleet, NOW, Policy(), pools=pools)
    assert decision.assigned() == {"small": "a"}
    assert "waits inside reservation 'r1' on a" in decision.annotations["big"].reason_pending


def test_a_job_whose_reservation_ended_is_denied_with_the_rule() -> None:
    ended = ReservationPool("r1", req(gpu_count=2), NOW - 10, "a", NOW - 1, ended=True)
    decision = schedule(
        [job("late", gpu_count=1, reservation_id="r1")], [worker("a")], NOW, Policy(), pools=[ended]
    )
    assert decision.assignments == ()
    assert [d.task_id for d in decision.denials] == ["late"]
    assert "§8.3" in decision.denials[0].note


def test_a_job_larger_than_its_reservation_is_denied() -> None:
    decision = schedule(
        [job("huge", gpu_count=4, reservation_id="r1")],
        [worker("a")],
        NOW,
        Policy(),
        pools=[pool("r1", "a", gpu_count=2)],
    )
    assert "can never run inside reservation 'r1'" in decision.denials[0].note


def test_a_job_of_a_reservation_not_placed_yet_waits_with_that_reason() -> None:
    fleet = [worker("a", jobs=[running("x", gpu_count=8, limit=60)])]
    decision = schedule(
        [job("in1", gpu_count=1, reservation_id="r1")],
        fleet,
        NOW,
        Policy(),
        pools=[pool("r1", gpu_count=8)],
    )
    assert decision.assignments == ()
    assert "reservation 'r1' is not placed yet" in decision.annotations["in1"].reason_pending
    assert "reservation:r1" in decision.annotations  # the reservation itself waits, estimated


def test_a_reservation_never_preempts() -> None:
    fleet = [worker("a", jobs=[running("spot", gpu_count=8, priority_class="spot")])]
    decision = schedule(
        [], fleet, NOW, Policy(), pools=[pool("r1", gpu_count=8, priority_class="reserved")]
    )
    assert decision.preemptions == ()
    assert decision.assignments == ()


def test_capacity_freed_inside_a_reservation_is_not_promised_to_a_job_outside_it() -> None:
    """A job inside a reservation gives its GPU back to the reservation, not to the fleet
    (§8.3: nothing else uses that capacity while it is held). A job outside that waits
    for it may only be promised it when the reservation ends, never at the end of the
    job inside. Found by `test_state_machine` (a reserved start of 22 s that never came)."""
    general = [running(f"g{i}", gpu_count=1) for i in range(7)]  # no time limit: never free
    inside = running("in0", gpu_count=1, reservation_id="r1", started=NOW, limit=20)
    fleet = [worker("a", jobs=[*general, inside])]
    forever = ReservationPool("r1", req(gpu_count=1), NOW - 10, "a", None)
    decision = schedule([job("out", gpu_count=1)], fleet, NOW, Policy(), pools=[forever])
    assert decision.annotations["out"].t_estimate is None, decision.annotations["out"]
    ends = ReservationPool("r1", req(gpu_count=1), NOW - 10, "a", NOW + 100)
    decision = schedule([job("out", gpu_count=1)], fleet, NOW, Policy(), pools=[ends])
    assert decision.annotations["out"].t_estimate == NOW + 100
    assert not decision.preemptions, "a job outside preempted one inside a reservation"


def test_a_job_of_a_reservation_sitting_out_a_give_back_waits_for_its_end() -> None:
    from dataclasses import replace

    fleet = [worker("a"), worker("b")]
    pools = [pool("r1", "b", gpu_count=2)]
    backed_off = replace(job("in1", gpu_count=2, reservation_id="r1"), not_before=NOW + 0.5)
    assert schedule([backed_off], fleet, NOW, Policy(), pools=pools).assignments == ()
    later = schedule([backed_off], fleet, NOW + 0.6, Policy(), pools=pools)
    assert later.assigned() == {"in1": "b"}
