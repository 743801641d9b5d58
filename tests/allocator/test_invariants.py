"""Random interleavings of alloc/hold/free/cancel/prioritise/pump/expire.

After every step: invariant 1 (capacity safety: no device in two allocations,
every counted sum within capacity). After every start: invariant 4 as the
backfill rule states it (a new allocation leaves every held request ranked
ahead of it the resources it is waiting for), `pump` serves the queue in
order, and `pump` is maximal (a second pump starts nothing).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from celery_ojs_ml.allocator import Allocation, Allocator, Demand, Denied, Pending
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.testing.builders import worker_with
from tests.allocator.helpers import FakeClock, job

CAPS = worker_with(gpus=4, gpu_type="nvidia-a100", cpu_cores=32, ram_gb=256)
TOTAL = Demand(4, 32, 256, 0)


@st.composite
def requests(draw: st.DrawFn) -> MLRequirements:
    attrs: dict[str, Any] = {}
    gpus = draw(st.integers(0, 5))
    if gpus:
        attrs["gpu_count"] = gpus
    if draw(st.booleans()):
        attrs["cpu_cores"] = draw(st.integers(1, 36))
    if draw(st.booleans()):
        attrs["memory_gb"] = float(draw(st.integers(0, 300)))
    band = draw(st.sampled_from([None, "spot", "on-demand", "reserved"]))
    if band:
        attrs["priority_class"] = band
    return job(**attrs)


# Named functions, not lambdas: Hypothesis describes a precondition lambda by parsing its
# source file with `ast`, and CPython 3.11.7's AST constructor can raise a spurious
# SystemError ("recursion depth mismatch", python/cpython#106905) that fails the run.
def _seen_a_request(m: AllocatorMachine) -> bool:
    return bool(m.seen)


def _holds_an_allocation(m: AllocatorMachine) -> bool:
    return bool(m.a.allocations())


def _holds_a_pending(m: AllocatorMachine) -> bool:
    return bool(m.a.held())


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.a = Allocator(CAPS, clock=self.clock, reserve_cpu=0)
        self.n = 0
        self.seen: list[MLRequirements] = []

    def _new_key(self) -> str:
        self.n += 1
        return f"t{self.n}"

    @rule(req=requests(), priority=st.integers(0, 3), keep=st.booleans())
    def submit(self, req: MLRequirements, priority: int, keep: bool) -> None:
        key = self._new_key()
        before = self.a.held()
        self.seen.append(req)
        result = self.a.try_alloc(key, key, req, priority=priority)
        if isinstance(result, Allocation):
            assert_is_what_was_asked(result, req)
            mine = (-_rank(result.band), -priority, self.clock.now)
            ahead = [p for p in before if (-_rank(p.band), -p.priority, p.since) <= mine]
            assert_leaves_room(self.a, result, ahead)
        elif isinstance(result, Pending) and keep:
            self.a.hold(result)
        else:
            assert isinstance(result, Pending | Denied)

    @precondition(_seen_a_request)
    @rule(data=st.data(), priority=st.integers(0, 3))
    def submit_the_same_request_again(self, data: st.DataObject, priority: int) -> None:
        """The live gate passes one request object per kind of job (the admission's
        memo): the memoised verdicts are keyed on it."""
        req = data.draw(st.sampled_from(self.seen))
        key = self._new_key()
        result = self.a.try_alloc(key, key, req, priority=priority)
        if isinstance(result, Pending):
            self.a.hold(result)

    @precondition(_holds_an_allocation)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        alloc = data.draw(st.sampled_from(self.a.allocations()))
        assert self.a.free(alloc.key) == alloc
        assert self.a.free(alloc.key) is None

    @precondition(_holds_a_pending)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        pending = data.draw(st.sampled_from(self.a.held()))
        assert self.a.cancel(pending.key) is pending

    @precondition(_holds_a_pending)
    @rule(data=st.data(), priority=st.integers(0, 3))
    def prioritise(self, data: st.DataObject, priority: int) -> None:
        pending = data.draw(st.sampled_from(self.a.held()))
        self.a.prioritise(pending.key, priority)

    @rule()
    def pump(self) -> None:
        queue = self.a.held()
        asked = {p.key: p.req for p in queue}
        position: dict[Hashable, int] = {p.key: i for i, p in enumerate(queue)}
        started = self.a.pump()
        assert [position[s.key] for s in started] == sorted(position[s.key] for s in started)
        still = self.a.held()
        for alloc in started:
            assert_is_what_was_asked(alloc, asked[alloc.key])
            ahead = [p for p in still if position[p.key] < position[alloc.key]]
            assert_leaves_room(self.a, alloc, ahead)
        assert self.a.pump() == []

    @rule(seconds=st.integers(0, 30))
    def tick_and_expire(self, seconds: int) -> None:
        self.clock.advance(seconds)
        expired = self.a.expired(40)
        assert all(self.clock.now - p.since > 40 for p in expired)
        assert all(self.clock.now - p.since <= 40 for p in self.a.held())

    @invariant()
    def capacity_is_never_exceeded(self) -> None:
        allocs = self.a.allocations()
        devices = [d for a in allocs for d in a.devices]
        assert len(devices) == len(set(devices)), "a device is pinned twice"
        assert all(0 <= d < TOTAL.gpus for d in devices)
        used = Demand.total(a.demand for a in allocs)
        assert not used.short_of(TOTAL), f"{used} exceeds {TOTAL}"

    @invariant()
    def free_capacity_agrees_with_allocations(self) -> None:
        used = Demand.total(a.demand for a in self.a.allocations())
        free = self.a.free_capacity()
        assert (free.gpus, free.cpu_cores, free.memory_gb) == (
            4 - used.gpus,
            32 - used.cpu_cores,
            256 - used.memory_gb,
        )

    @invariant()
    def the_memoised_verdict_behind_held_jobs_is_the_full_assessment(self) -> None:
        """`assess_behind` (memo plus the backfill rule) answers as `assess` does."""
        queue = self.a.held()
        for i, pending in enumerate(queue):
            for req in (pending.req, *self.seen[-3:]):
                fast = self.a.book.assess_behind(req, queue[:i])
                full = self.a.book.assess(req, queue[:i])
                assert (fast.verdict, fast.why) == (full.verdict, full.why)

    @invariant()
    def the_capacity_key_counts_the_running_jobs_by_shape(self) -> None:
        """The cached, incrementally kept shape equals one recounted from scratch."""
        recount: dict[Any, int] = {}
        for j in self.a.book.jobs().values():
            recount[j.shape] = recount.get(j.shape, 0) + 1
        assert self.a.capacity_key() == (frozenset(recount.items()), bool(self.a.held()))


def _rank(band: str) -> int:
    return ["spot", "on-demand", "reserved"].index(band)


def assert_is_what_was_asked(alloc: Allocation, req: MLRequirements) -> None:
    """The allocation holds exactly the request's counted resources (omitted: 0)."""
    assert len(alloc.devices) == (req.ext_ml_gpu_count or 0)
    assert alloc.cpu_cores == (req.ext_ml_cpu_cores or 0)
    assert alloc.memory_gb == (req.ext_ml_memory_gb or 0)


def assert_leaves_room(a: Allocator, alloc: Allocation, ahead: list[Pending]) -> None:
    """Every resource `alloc` uses still covers what the held requests ahead of it need."""
    free = a.free_capacity()
    left = Demand(free.gpus or 0, free.cpu_cores or 0, free.memory_gb or 0, 0)
    need = Demand.total(Demand.of(p.req) for p in ahead)
    for (name, used), (_, have), (_, wanted) in zip(
        alloc.demand.items(), left.items(), need.items(), strict=True
    ):
        if used > 0:
            assert have >= wanted, f"{alloc.task_id} took {name} held for {ahead}"


AllocatorMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_random_sequences_keep_capacity_safety_and_priority_order = AllocatorMachine.TestCase
