"""Grants (`scheduler.grants`): which classes a quiet pass grants, and when grants end.

A grant sends a class's next jobs straight to one worker, so it may only follow a pass
that left nothing waiting, and only for jobs whose placement depends on nothing but
their class and the free capacity.
"""

from __future__ import annotations

from dataclasses import replace

from celery_ojs_ml.scheduler import Decision
from celery_ojs_ml.scheduler.grants import (
    grant_key,
    grantable,
    grants_after,
    job_grantable,
    quiet,
    to_revoke,
)
from celery_ojs_ml.scheduler.model import Annotation, Assignment, Preemption, Reservation
from tests.scheduler.helpers import decide, job, req, worker


def _assigned(*pairs: tuple[str, str]) -> Decision:
    return Decision(assignments=tuple(Assignment(t, w, 0.0) for t, w in pairs))


def test_a_quiet_pass_grants_each_class_to_the_worker_its_last_job_went_to() -> None:
    jobs = {f"j{i}": job(f"j{i}", at=i, gpu_count=1) for i in range(3)}
    key = grant_key("celery", "on-demand", jobs["j0"].class_key)
    made = grants_after(_assigned(("j0", "a"), ("j1", "b"), ("j2", "b")), jobs, {}, 3)
    assert made == {key: "b"}


def test_a_pass_that_leaves_a_job_waiting_grants_nothing() -> None:
    jobs = {f"j{i}": job(f"j{i}", at=i, gpu_count=1) for i in range(2)}
    waits = Decision(
        assignments=(Assignment("j0", "a", 0.0),),
        annotations={"j1": Annotation("j1", "no free GPU", None)},
    )
    assert grants_after(waits, jobs, {}, 2) == {}
    assert not quiet(waits, 2)
    # a job outside what the pass saw (the window) also waits: not quiet
    assert grants_after(_assigned(("j0", "a")), jobs, {}, 2) == {}


def test_preemption_denial_or_reservation_makes_a_pass_not_quiet() -> None:
    base = _assigned(("j0", "a"))
    assert quiet(base, 1)
    assert not quiet(replace(base, preemptions=(Preemption("j9", "a", ("v",)),)), 1)
    assert not quiet(replace(base, reservations=(Reservation("j9", "a", 5.0),)), 1)


def test_one_class_per_worker_and_one_worker_per_class() -> None:
    one = job("a1", gpu_count=1)
    two = job("b1", gpu_count=2)
    jobs = {"a1": one, "b1": two}
    key_one = grant_key("celery", "on-demand", one.class_key)
    key_two = grant_key("celery", "on-demand", two.class_key)
    made = grants_after(_assigned(("a1", "w"), ("b1", "w")), jobs, {}, 2)
    assert made == {key_one: "w"}  # the second class would share the worker's queue
    assert grants_after(_assigned(("b1", "v")), jobs, {key_two: "w"}, 1) == {}
    assert grants_after(_assigned(("b1", "v")), jobs, {key_one: "v"}, 1) == {}


def test_jobs_placed_by_more_than_their_class_are_never_granted() -> None:
    plain = job("p", gpu_count=1)
    assert job_grantable(plain)
    assert not job_grantable(replace(plain, gang="g", gang_size=2))
    assert not job_grantable(replace(plain, gpu_affinity="spread"))
    assert not job_grantable(replace(plain, labels={"team": "x"}))
    assert job_grantable(replace(plain, labels={"job_type": "t", "queue": "celery"}))
    assert not grantable(req(gpu_count=1, reservation_id="r1"), gang=False, labels=False,
                         gpu_affinity="pack")  # fmt: skip
    escalating = req(
        gpu_count=1,
        priority_class="spot",
        priority_escalation=True,
        escalation_after_s=30,
        escalation_target_class="reserved",
    )
    assert not grantable(escalating, gang=False, labels=False, gpu_affinity="pack")
    jobs = {"g": replace(plain, task_id="g", gang="g", gang_size=1)}
    assert grants_after(_assigned(("g", "w")), jobs, {}, 1) == {}


def test_the_grant_key_separates_queues_and_bands() -> None:
    spot = job("s", gpu_count=1, priority_class="spot")
    other = job("o", gpu_count=1, queue="batch")
    keys = {grant_key(j.queue, j.band, j.class_key) for j in (spot, other, job("d", gpu_count=1))}
    assert len(keys) == 3


def test_grants_end_when_the_holder_leaves_or_has_a_backlog_while_another_worker_has_room() -> None:
    held = {"k1": "a", "k2": "b", "k3": "c"}
    gone = to_revoke(
        held,
        live=["a", "b"],
        backlog={"a": 4, "b": 3},
        room_elsewhere={"k1": False, "k2": True, "k3": True},
    )
    assert sorted(gone) == ["k2", "k3"]  # k3: holder left; k2: queued while room elsewhere
    assert to_revoke(held, ["a", "b", "c"], {"b": 0}, {"k2": True}) == []


def test_a_granted_class_is_placed_where_the_core_places_it() -> None:
    """The grant follows the core's own best fit: a 1-GPU job on the 1-GPU worker."""
    small, big = worker("small", "nvidia-l4x1"), worker("big", "nvidia-a100x8")
    one = job("j", gpu_count=1)
    decision = decide([one], [big, small])
    made = grants_after(decision, {"j": one}, {}, 1)
    assert list(made.values()) == ["small"]
