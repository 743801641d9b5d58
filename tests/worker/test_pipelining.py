"""Pipelining (`worker.pipelining`): the router writes a follower to the busy child of the
job it follows and to no other; the allocator hands it exactly that job's devices.

These drive the router over a stand-in for billiard's fair write scheduler and the
allocator directly; the real prefork runs are tests/integration/test_pipelining.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from celery_ojs_ml.allocator import Pending
from celery_ojs_ml.worker import warm_pool
from celery_ojs_ml.worker.pipelining import Pipeline
from tests.allocator.helpers import allocator, job, run, started, waiting
from tests.worker.test_warm_routing import (  # noqa: F401
    BUSY,
    IDLE,
    Pool,
    bound_children,
    gate_with,
    router_for,
)

ONE = job(gpu_count=1)


class Req:
    """A celery Request as the gate keys it (by identity)."""

    def __init__(self, task_id: str, headers: dict[str, Any] | None = None) -> None:
        self.id, self.name, self.request_dict = task_id, "serve", headers or {}


class FairPool(Pool):
    """billiard's fair strategy: a busy or half-written child gets nothing; a write marks
    the child busy."""

    def schedule_writes(self, ready: list[int], *args: Any) -> None:
        for fd in ready:
            if fd in self._busy_workers or fd in self._active_writes or not self.outbound_buffer:
                continue
            job = self.outbound_buffer.popleft()
            self.writes.append((fd, job.correlation_id))
            self._busy_workers.add(fd)


def _leading() -> tuple[Any, FairPool, warm_pool.Router]:
    """`lead` runs on GPU 0 in the BUSY child (written there, not moved)."""
    gate = gate_with("lead")
    pool = FairPool()
    router = router_for(gate, pool)
    router._written.add("lead")
    router._record("lead", BUSY)
    return gate, pool, router


@pytest.mark.usefixtures("bound_children")
def test_a_follower_is_written_to_the_busy_child_of_its_lead_and_to_no_other() -> None:
    _, pool, router = _leading()
    assert router.may_follow("lead")
    router.follow("next", "lead")
    pool.outbound_buffer.append(SimpleNamespace(correlation_id="next"))
    router.schedule([IDLE])
    assert pool.writes == [(BUSY, "next")], "written behind the lead, not to the idle child"
    assert BUSY in pool._busy_workers and router.pipelined == 1
    assert not router.may_follow("lead"), "one job behind a running one at most"


@pytest.mark.usefixtures("bound_children")
def test_the_child_with_a_follower_stays_busy_after_its_lead_returns() -> None:
    _, pool, router = _leading()
    router.follow("next", "lead")
    pool.outbound_buffer.append(SimpleNamespace(correlation_id="next"))
    router.schedule([IDLE])
    pool._busy_workers.discard(BUSY)  # the lead's result: billiard marks the child available
    router.finished("lead")
    router.handed_over("next")
    pool.outbound_buffer.append(SimpleNamespace(correlation_id="plain"))
    router.schedule([BUSY, IDLE])
    assert pool.writes[-1] == (IDLE, "plain"), "the child still has the follower to run"
    assert router.may_follow("next"), "the follower, now running, may lead the next one"
    router.finished("next")
    assert not router._busy_behind(BUSY)


@pytest.mark.usefixtures("bound_children")
def test_a_follower_whose_lead_is_being_written_waits_and_is_never_routed_elsewhere() -> None:
    _, pool, router = _leading()
    pool._active_writes.add(BUSY)
    router.follow("next", "lead")
    pool.outbound_buffer.append(SimpleNamespace(correlation_id="next"))
    router.schedule([IDLE])
    assert pool.writes == [] and len(pool.outbound_buffer) == 1
    assert pool._busy_workers == {BUSY}, "the busy set is as it was"


@pytest.mark.usefixtures("bound_children")
def test_nothing_follows_a_job_that_was_moved_onto_other_devices() -> None:
    gate = gate_with("lead")
    router = router_for(gate, FairPool())
    router._moved["lead"] = 1
    router._announce(BUSY, "lead")  # its child reads the move when it starts the job
    router._record("lead", BUSY)
    assert not router.may_follow("lead")


def test_a_hand_over_gives_the_follower_exactly_the_devices_of_the_job_it_follows() -> None:
    a = allocator()
    lead = run(a, "lead", ONE)
    run(a, "other", ONE)
    freed, taken = a.hand_over("lead", "next", "next", ONE) or (None, None)
    assert freed is not None and taken is not None
    assert taken.devices == lead.devices and a.free("lead") is None
    assert {x.task_id for x in a.allocations()} == {"other", "next"}


def test_a_hand_over_ignores_the_backfill_rule_the_follower_is_already_in_its_child() -> None:
    a = allocator()
    lead = run(a, "lead", job(gpu_count=1))
    for name in ("b", "c", "d"):
        run(a, name, ONE)
    big = waiting(a.try_alloc("big", "big", job(gpu_count=4, priority_class="reserved")))
    a.hold(big)
    assert isinstance(a.try_alloc("late", "late", ONE), Pending), "a newcomer waits behind it"
    found = a.hand_over("lead", "next", "next", ONE)
    assert found is not None and found[1].devices == lead.devices


def test_a_hand_over_from_a_job_that_holds_nothing_gives_nothing() -> None:
    a = allocator()
    started(a.try_alloc("x", "x", ONE))
    assert a.hand_over("gone", "next", "next", ONE) is None
    assert [x.task_id for x in a.allocations()] == ["x"]


def _pipeline(lead_runs: float | None) -> tuple[Pipeline, Any]:
    """A Pipeline over an allocator running `lead` (1 GPU); `lead_runs`: how long the
    task's last run took here (None: it never ran)."""
    from celery_ojs_ml.wire.settings import OJSMLSettings
    from celery_ojs_ml.worker.running import Running

    a = allocator()
    lead = Req("lead")
    started(a.try_alloc(lead, "lead", ONE))
    router = SimpleNamespace(may_follow=lambda task_id: True, follow=lambda *args: None)
    pipe = Pipeline(OJSMLSettings(), a, Running(), set(), router=router,  # type: ignore[arg-type]
                    requirements=lambda req: ONE, batched=lambda req: False)  # fmt: skip
    if lead_runs is not None:
        pipe.last_run_s["serve"] = lead_runs
    return pipe, lead


@pytest.mark.parametrize(
    ("last_run", "follows"), [(None, False), (0.004, True), (30.0, False)],
    ids=["never ran here", "short", "long"],
)  # fmt: skip
def test_a_job_follows_only_a_task_whose_last_run_here_was_short(
    last_run: float | None, follows: bool
) -> None:
    pipe, lead = _pipeline(last_run)
    follower = Req("next")
    found = pipe.ahead_for(follower, ONE)
    assert (found is not None and found.key is lead) is follows


def test_a_job_with_other_needs_a_gang_rank_or_a_second_follower_follows_nothing() -> None:
    pipe, _ = _pipeline(0.004)
    other = Req("x")
    assert pipe.ahead_for(other, job(gpu_count=1, gpu_memory_min_gb=40)) is None
    rank = Req("r", {"ojs_rendezvous": {}})
    assert pipe.ahead_for(rank, ONE) is None
    first = Req("n1")
    found = pipe.ahead_for(first, ONE)
    assert found is not None
    pipe.follow(first, ONE, found)
    assert pipe.ahead_for(Req("n2"), ONE) is None
