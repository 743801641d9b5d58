"""Grants (`scheduler.grants`): which classes a quiet pass grants, and when grants end.

A grant sends a class's next jobs straight to one worker, so it may only follow a pass
that left nothing waiting, and only for jobs whose placement depends on nothing but
their class and the free capacity.
"""

from __future__ import annotations

from dataclasses import replace

from celery_ojs_ml.scheduler import Decision
from celery_ojs_ml.scheduler.grants import (
    contested,
    foreign,
    grant_key,
    grantable,
    grants_after,
    job_grantable,
    to_revoke,
)
from celery_ojs_ml.scheduler.model import Annotation, Assignment, Preemption, Reservation
from tests.scheduler.helpers import decide, job, req, worker


def _assigned(*pairs: tuple[str, str]) -> Decision:
    return Decision(assignments=tuple(Assignment(t, w, 0.0) for t, w in pairs))


def test_a_quiet_pass_grants_each_class_to_the_worker_its_last_job_went_to() -> None:
    jobs = {f"j{i}": job(f"j{i}", at=i, gpu_count=1) for i in range(3)}
    key = grant_key("celery", "on-demand", jobs["j0"].class_key)
    made = grants_after(_assigned(("j0", "a"), ("j1", "b"), ("j2", "b")), jobs, {}, frozenset())
    assert made == {key: "b"}


def test_a_waiting_job_blocks_grants_on_every_worker_it_could_use_and_only_there() -> None:
    """A job left waiting contests the workers that consume its queue and match it: no
    grant there (and the leader revokes the ones there); elsewhere grants go on."""
    small = job("j0", gpu_count=1)
    big = job("j1", gpu_count=8)
    other = job("j2", gpu_count=1, queue="batch")
    jobs = {"j0": small, "j1": big, "j2": other}
    fleet = [worker("a8"), worker("b8"), worker("l4", "nvidia-l4x1")]
    waits = Decision(
        assignments=(Assignment("j0", "l4", 0.0),),
        annotations={"j1": Annotation("j1", "no 8 free GPUs", None)},
    )
    blocked = contested(waits, jobs, fleet, 2)
    assert blocked == frozenset({"a8", "b8"})  # an 8-GPU job cannot use the 1-GPU worker
    assert list(grants_after(waits, jobs, {}, blocked).values()) == ["l4"]
    # a waiting job of a queue nobody here consumes contests no worker
    queued = Decision(annotations={"j2": Annotation("j2", "no worker consumes batch", None)})
    assert contested(queued, jobs, fleet, 1) == frozenset()
    # a job the pass did not see (the window): every worker is contested
    assert contested(_assigned(("j0", "a8")), jobs, fleet, 2) is None
    assert grants_after(_assigned(("j0", "a8")), jobs, {}, None) == {}


def test_preemption_denial_or_reservation_contests_the_jobs_workers() -> None:
    jobs = {"j9": job("j9", gpu_count=1)}
    fleet = [worker("a8")]
    base = Decision()
    for decision in (
        replace(base, preemptions=(Preemption("j9", "a8", ("v",)),)),
        replace(base, reservations=(Reservation("j9", "a8", 5.0),)),
    ):
        assert contested(decision, jobs, fleet, 0) == frozenset({"a8"})
    assert contested(replace(base, preemptions=(Preemption("x", "a8", ()),)), {}, fleet, 0) is None


def test_one_class_per_worker_and_one_worker_per_class() -> None:
    one = job("a1", gpu_count=1)
    two = job("b1", gpu_count=2)
    jobs = {"a1": one, "b1": two}
    key_one = grant_key("celery", "on-demand", one.class_key)
    key_two = grant_key("celery", "on-demand", two.class_key)
    none: frozenset[str] = frozenset()
    made = grants_after(_assigned(("a1", "w"), ("b1", "w")), jobs, {}, none)
    assert made == {key_one: "w"}  # the second class would share the worker's queue
    assert grants_after(_assigned(("b1", "v")), jobs, {key_two: "w"}, none) == {}
    assert grants_after(_assigned(("b1", "v")), jobs, {key_one: "v"}, none) == {}


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
    assert grants_after(_assigned(("g", "w")), jobs, {}, frozenset()) == {}


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
    made = grants_after(decision, {"j": one}, {}, contested(decision, {"j": one}, [big, small], 1))
    assert list(made.values()) == ["small"]


def test_an_assignment_of_another_class_to_a_holder_ends_its_grant_one_of_its_class_does_not() -> (
    None
):
    """An assignment's message would queue behind the granted backlog on the holder."""
    one, two = job("a", gpu_count=1), job("b", gpu_count=2)
    jobs = {"a": one, "b": two}
    held = {grant_key("celery", "on-demand", one.class_key): "w"}
    assert foreign(_assigned(("b", "w")), jobs, held) == frozenset({"w"})
    assert foreign(_assigned(("a", "w")), jobs, held) == frozenset()
    assert foreign(_assigned(("b", "v")), jobs, held) == frozenset()


def test_a_grant_ends_once_a_job_sent_under_it_has_waited_past_the_bound() -> None:
    """`stale`: the holder's oldest job sent under the grant waited `ojs_ml_grant_wait_s`."""
    held = {"k1": "a", "k2": "b"}
    gone = to_revoke(held, ["a", "b"], {"a": 5, "b": 5}, {}, stale=frozenset({"b"}))
    assert gone == ["k2"]


def test_no_grant_goes_to_a_worker_the_pass_left_without_a_free_pool_process() -> None:
    """The class's next job would wait there in the pool while another worker could start
    it; where processes are not counted (None) the grant is made."""
    one, four = worker("one", "nvidia-a100x2", processes=1), worker("four", "nvidia-a100x4")
    jobs = {"j": job("j", gpu_count=1)}
    assert grants_after(_assigned(("j", "one")), jobs, {}, frozenset(), [one, four]) == {}
    assert list(grants_after(_assigned(("j", "four")), jobs, {}, frozenset(), [one, four])) != []
    two = worker("two", "nvidia-a100x2", processes=2)
    assert list(grants_after(_assigned(("j", "two")), jobs, {}, frozenset(), [two]).values()) == [
        "two"
    ]
