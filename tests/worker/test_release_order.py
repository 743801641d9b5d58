"""A job's end on the warm path (`worker.gate_release`): the held job that now fits is
dispatched and written to its child before the finished job's ack and the leader's
wake-up, and the lease release still goes out.

These drive the gate's release with stand-ins for its collaborators; the real prefork
runs are tests/integration/test_prefetch.py and test_warm_children.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from celery_ojs_ml.allocator import Allocation
from celery_ojs_ml.child import warm_slot
from celery_ojs_ml.store.lease_writer import LeaseWriter
from celery_ojs_ml.wire.headers import PREFETCH
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker import warm_pool
from celery_ojs_ml.worker.gate import Gate
from celery_ojs_ml.worker.lease_keeping import LeaseKeeper
from celery_ojs_ml.worker.running import Running
from tests.allocator.helpers import allocator, job, started, waiting
from tests.worker.test_warm_routing import IDLE, Pool, bound_children  # noqa: F401

FOUR = job(gpu_count=4)


class Req:
    """A celery Request as the gate keys it (by identity)."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id
        self.request_dict: dict[str, Any] = {}

    def revoked(self) -> bool:
        return False


def gate_with(calls: list[tuple[str, ...]], *, acks_at_release: bool) -> tuple[Any, Req, Req]:
    """A gate running `done` on all four GPUs with `held` waiting behind it; every
    collaborator records its calls in `calls`."""
    gate: Any = object.__new__(Gate)
    running = Running()
    gate.running, gate.lock, gate.allocator = running, running.lock, allocator()
    gate.requests, gate.devices_by_id = running.requests, running.devices_by_id
    gate.hold_until, gate._pump_due, gate._pumping = running.hold_until, False, False
    done, held = Req("done"), Req("held")
    started(gate.allocator.try_alloc(done, "done", FOUR))
    gate.allocator.hold(waiting(gate.allocator.try_alloc(held, "held", FOUR)))
    running.tokens[done] = "token-done"

    def release_lease(task_id: str, token: str, acks: list[Any]) -> None:
        calls.append(("release_lease", task_id, token))
        if acks_at_release:  # it ended before its lease was due: its message is unacked
            acks.append(done)

    def dispatch(req: Any, alloc: Allocation) -> None:
        calls.append(("dispatch", req.id, *map(str, alloc.devices)))

    gate._release_lease, gate._dispatch = release_lease, dispatch
    gate._ack = lambda req: calls.append(("ack", req.id))
    gate.wake_scheduler = lambda: calls.append(("wake",))
    gate.resubscribe = lambda: None
    gate.preemptions = SimpleNamespace(finished=lambda req: None)
    gate.router = SimpleNamespace(
        finished=lambda task_id: calls.append(("router.finished", task_id)),
        write_now=lambda: calls.append(("write_now",)),
    )
    gate.grants = SimpleNamespace(granted_held=set(), quiet_release=lambda req: False)
    gate.settings = OJSMLSettings()
    gate.c = SimpleNamespace(hub=None, qos=SimpleNamespace(decrement_eventually=lambda: None))
    return gate, done, held


def test_the_held_job_is_written_to_its_child_before_the_ack_and_the_wake_up() -> None:
    calls: list[tuple[str, ...]] = []
    gate, done, _ = gate_with(calls, acks_at_release=True)
    gate.release(done)
    assert calls == [
        ("router.finished", "done"),
        ("release_lease", "done", "token-done"),
        ("dispatch", "held", "0", "1", "2", "3"),
        ("write_now",),
        ("ack", "done"),
        ("wake",),
    ]


def test_a_job_whose_lease_was_written_is_not_acked_again_at_its_end() -> None:
    calls: list[tuple[str, ...]] = []
    gate, done, _ = gate_with(calls, acks_at_release=False)
    gate.release(done)
    assert ("ack", "done") not in calls
    assert calls[-1] == ("wake",) and ("release_lease", "done", "token-done") in calls


def test_a_job_whose_lease_could_not_be_written_is_acked_after_the_pump() -> None:
    calls: list[tuple[str, ...]] = []
    gate, done, _ = gate_with(calls, acks_at_release=False)
    gate.running.unacked[done] = True
    gate.release(done)
    assert calls[-3:] == [("write_now",), ("ack", "done"), ("wake",)]


def test_a_release_with_nothing_held_pumps_on_the_next_turn_and_wakes_the_leader() -> None:
    calls: list[tuple[str, ...]] = []
    gate, done, held = gate_with(calls, acks_at_release=True)
    gate.allocator.cancel(held)  # the held job went elsewhere
    soon: list[Any] = []
    gate.c.hub = SimpleNamespace(call_soon=soon.append)
    gate.release(done)
    assert soon == [gate.pump] and calls[-2:] == [("ack", "done"), ("wake",)]
    assert not any(c[0] in ("dispatch", "write_now") for c in calls)


@pytest.mark.parametrize(("sent_ahead", "wakes"), [(1, True), (2, False)])
def test_a_release_wakes_the_leader_only_once_the_jobs_sent_ahead_run_low(
    sent_ahead: int, wakes: bool
) -> None:
    """`ojs_ml_prefetch` 2: while one job sent ahead still waits after the release
    started another, the scheduler has nothing to send; it is woken when none is left."""
    calls: list[tuple[str, ...]] = []
    gate, done, held = gate_with(calls, acks_at_release=True)
    held.request_dict[PREFETCH] = True
    for n in range(sent_ahead - 1):
        more = Req(f"ahead-{n}")
        more.request_dict[PREFETCH] = True
        gate.allocator.hold(waiting(gate.allocator.try_alloc(more, more.id, FOUR)))
    gate.release(done)
    assert ("dispatch", "held", "0", "1", "2", "3") in calls
    assert (("wake",) in calls) is wakes


def test_write_now_routes_the_waiting_job_to_an_idle_child(bound_children: None) -> None:  # noqa: F811
    pool = Pool()
    hub = SimpleNamespace(consolidate_callback=pool.schedule_writes)
    table = warm_slot.table()
    assert table is not None
    router = warm_pool.Router(pool, hub, {"j": (1,)}.get, lambda *a: {}, table)
    router.write_now()
    assert pool.writes == [], "nothing waits: nothing is written"
    pool.outbound_buffer.append(SimpleNamespace(correlation_id="j"))
    router.write_now()
    assert pool.writes == [(IDLE, "j")] and "j" in router._written


def _keeper() -> tuple[LeaseKeeper, list[str]]:
    keeper: Any = object.__new__(LeaseKeeper)
    keeper._collecting, keeper.unacked = threading.local(), {}
    acked: list[str] = []
    keeper.ack = lambda req: acked.append(req.id)
    keeper.writer = LeaseWriter(SimpleNamespace(), defer=lambda fn, delay_s: None)
    return keeper, acked


def test_release_lease_leaves_the_ack_of_a_job_without_a_lease_to_its_caller() -> None:
    keeper, acked = _keeper()
    req = Req("short")
    token = keeper.writer.take("short", {}, lambda ok: keeper._lease_written(req, ok))
    acks: list[Any] = []
    keeper.release_lease("short", token, acks)
    assert acks == [req] and acked == []
    assert keeper.writer.pending() == 0, "a lease never written needs no release"


def test_release_lease_without_a_list_acks_at_once() -> None:
    keeper, acked = _keeper()
    req = Req("short")
    token = keeper.writer.take("short", {}, lambda ok: keeper._lease_written(req, ok))
    keeper.release_lease("short", token)
    assert acked == ["short"]
