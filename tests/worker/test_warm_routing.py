"""Warm children with fewer pool processes than GPUs: a job that waits for a
pool child is routed to an idle warm child before a later job can take that child.

With `-c 2` on a 4-GPU worker, dispatched jobs beyond two hold their devices while
they wait for a process (celery's pool semaphore, then the pool's outbound buffer).
When a later job takes the devices an idle warm child is bound to, the waiting job
used to find no child and a warm child was retired for it. The router now exchanges
the two jobs' devices while no child has taken the later one. These tests drive the
router and the gate's move over a stand-in for the pool's write scheduler (the real
prefork run is `tests/integration/test_warm_children.py`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from celery_ojs_ml.child import warm_slot
from celery_ojs_ml.wire.warm_slots import devices_of_mask, mask_of
from celery_ojs_ml.worker import warm_pool
from celery_ojs_ml.worker.gate import Gate
from celery_ojs_ml.worker.running import Running
from tests.allocator.helpers import allocator, job, started

ONE = job(gpu_count=1)
BUSY, IDLE = 11, 15
"""Two pool children: BUSY (index 0, bound to GPU 0, running a job), IDLE (index 1, GPU 1)."""


class Req:
    """A celery Request as the gate keys it (by identity)."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id
        self.request_dict: dict[str, Any] = {}


class Pool:
    """The parts of celery's AsynPool the router reads, and its write scheduler."""

    def __init__(self) -> None:
        self.outbound_buffer: deque[Any] = deque()
        self._fileno_to_inq = {
            BUSY: SimpleNamespace(index=0, pid=100),
            IDLE: SimpleNamespace(index=1, pid=101),
        }
        self._busy_workers = {BUSY}
        self._active_writes: set[int] = set()
        self.writes: list[tuple[int, str]] = []

    def schedule_writes(self, ready: list[int], *args: Any) -> None:
        job = self.outbound_buffer.popleft()
        self.writes.append((ready[0], job.correlation_id))


@pytest.fixture
def bound_children() -> Iterator[None]:
    warm_slot.make_table()
    slots = warm_slot._TABLE["slots"]
    slots[0], slots[1] = mask_of([0]), mask_of([1])
    yield
    slots[0] = slots[1] = warm_slot._TABLE["next"][1] = 0


def gate_with(*jobs: str) -> Any:
    """The gate's state as `_dispatch` leaves it: each job running on the allocator."""
    gate: Any = object.__new__(Gate)
    running = Running()
    gate.lock, gate.allocator = running.lock, allocator()
    gate.requests, gate.devices_by_id = running.requests, running.devices_by_id
    for task_id in jobs:
        req = Req(task_id)
        devices = started(gate.allocator.try_alloc(req, task_id, ONE)).devices  # keyed by req
        gate.requests[task_id], gate.devices_by_id[task_id] = req, devices
        req.request_dict["ojs_devices"] = list(devices)
    return gate


def router_for(gate: Any, pool: Pool) -> warm_pool.Router:
    hub = SimpleNamespace(consolidate_callback=pool.schedule_writes)
    table = warm_slot.table()
    assert table is not None
    return warm_pool.Router(pool, hub, gate.devices_by_id.get, gate.move, table)


def test_a_waiting_job_takes_the_idle_warm_child_from_a_later_job_no_child_has_taken(
    bound_children: None,
) -> None:
    gate = gate_with("running", "later", "waiting")  # GPUs 0, 1, 2
    pool = Pool()
    router = router_for(gate, pool)
    router._written.add("running")
    pool.outbound_buffer.append(SimpleNamespace(correlation_id="waiting"))
    router.schedule([IDLE])
    assert pool.writes == [(IDLE, "waiting")], "the waiting job goes to the idle warm child"
    assert gate.devices_by_id["waiting"] == (1,) and gate.devices_by_id["later"] == (2,)
    assert gate.requests["later"].request_dict["ojs_devices"] == [2]
    assert devices_of_mask(warm_slot._TABLE["next"][1]) == [1], "the child is told"
    assert router.retired == 0
    pool.outbound_buffer.append(SimpleNamespace(correlation_id="later"))
    pool._busy_workers = {IDLE}
    router.schedule([BUSY])  # the later job, now on GPU 2, waits for a child bound to it
    assert pool.writes == [(IDLE, "waiting")] and router._moved["later"] == mask_of([2])


def test_a_job_a_child_has_already_taken_keeps_its_devices(bound_children: None) -> None:
    gate = gate_with("running", "taken", "waiting")
    pool = Pool()
    router = router_for(gate, pool)
    router._written.update({"running", "taken"})
    pool.outbound_buffer.append(SimpleNamespace(correlation_id="waiting"))
    router.schedule([IDLE])
    assert pool.writes == [], "no child is bound to GPU 2 and GPU 1 is taken"
    assert gate.devices_by_id["taken"] == (1,) and gate.devices_by_id["waiting"] == (2,)
    router.finished("taken")
    assert "taken" not in router._written
