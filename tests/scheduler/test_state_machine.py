"""Random fleets over time: arrivals, completions, worker joins and losses, preemptions.

After every pass: capacity safety (DESIGN invariant 1), no wrong placement
(2), band order (4, rule 1) and the backfill rule (7: every reservation still
fits at its start beside every job that could still be there). Across passes:
the job first in fleet order starts by the first reserved start it was given
(7, no starvation), as long as it stays first and no worker is lost. With a
`train` budget (§10.3), the queue never holds more GPUs than its budget.
With dynamic reservations (§8.3): jobs outside a placed reservation fit the
fleet with the reservation carved out (the checks above run on that view), a
job naming a reservation runs only on its worker and within it, and no
worker ever holds more than it has, reservations included.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from celery_ojs_ml.scheduler import Budget, Decision, Policy, ReservationPool, in_order
from celery_ojs_ml.scheduler.pools import PREFIX, hold, open_queues
from tests.scheduler import checks
from tests.scheduler.helpers import caps, job, req
from tests.scheduler.sim import Sim, SimWorker

PROFILES = ("nvidia-a100x8", "nvidia-a100x2", "nvidia-l4x1", "cpu")
KINDS: tuple[dict[str, Any], ...] = (
    {"gpu_count": 1},
    {"gpu_count": 2},
    {"gpu_count": 4},
    {"gpu_count": 8},
    {"gpu_count": 1, "gpu_type": "nvidia-l4"},
    {"gpu_count": 1, "gpu_memory_gb": 40},
    {"cpu_cores": 8, "memory_gb": 32},
    {"gpu_count": 1, "cpu_cores": 16},
)
EPS = 1e-6


# Named functions, not lambdas: Hypothesis describes a lambda by parsing its source file
# with `ast`, and CPython 3.11.7's AST constructor can raise a spurious SystemError
# ("recursion depth mismatch", python/cpython#106905) that fails the run.
def _flatten_kind(d: dict[str, Any]) -> dict[str, Any]:
    return {**d.pop("kind"), **d}


def _room_to_join(m: FleetMachine) -> bool:
    return len(m.sim.workers) < 5


def _two_or_more_workers(m: FleetMachine) -> bool:
    return len(m.sim.workers) > 1


def _room_to_arrive(m: FleetMachine) -> bool:
    return len(m.sim.pending) < 25


def _room_to_reserve(m: FleetMachine) -> bool:
    return len(m.sim.pools) < 3


def _a_live_pool(m: FleetMachine) -> bool:
    return any(not p.ended for p in m.sim.pools.values())


JOBS = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(KINDS),
        "priority_class": st.sampled_from(["spot", "spot", "on-demand", "reserved"]),
        "priority": st.integers(0, 2),
        "limit": st.sampled_from([None, 5.0, 20.0, 60.0, 200.0]),
        "share": st.floats(0.1, 1.0),
        "queue": st.sampled_from(["celery"] * 7 + ["train"]),
        "gpu_affinity": st.sampled_from(["pack"] * 6 + ["spread", "dedicated"]),
    }
).map(_flatten_kind)


class FleetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sim = Sim()
        self.n = 0
        self.budget: int | None = None
        self.first: tuple[str, float] | None = None
        """(task id first in order, the reserved start it must start by)."""

    @initialize(
        depth=st.sampled_from([1, 2]),
        profiles=st.lists(st.sampled_from(PROFILES), min_size=1, max_size=3),
        budget=st.sampled_from([None, 2, 8]),
    )
    def start(self, depth: int, profiles: list[str], budget: int | None) -> None:
        budgets = () if budget is None else (("train", Budget(max_total_gpus=budget)),)
        self.budget = budget
        self.sim.policy = Policy(
            reservation_depth=depth, min_runtime_before_preemption_s=10, budgets=budgets
        )
        for p in profiles:
            self.join(p)

    @precondition(_room_to_join)
    @rule(profile=st.sampled_from(PROFILES))
    def join(self, profile: str) -> None:
        self.n += 1
        queues = frozenset({"celery", "train"}) if self.n % 3 == 0 else frozenset({"celery"})
        self.sim.workers[f"w{self.n}"] = SimWorker(caps(profile), queues=queues)

    @precondition(_two_or_more_workers)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        self.sim.lose(data.draw(st.sampled_from(sorted(self.sim.workers))))
        self.first = None  # the reserved capacity may be gone

    @precondition(_room_to_arrive)
    @rule(jobs=st.lists(JOBS, min_size=1, max_size=4))
    def arrive(self, jobs: list[dict[str, Any]]) -> None:
        for spec in jobs:
            self.n += 1
            duration = (spec["limit"] or 300.0) * spec.pop("share")
            self.sim.submit(job(f"j{self.n}", **spec), duration)

    @precondition(_room_to_reserve)
    @rule(gpus=st.sampled_from([1, 2, 4]))
    def reserve(self, gpus: int) -> None:
        self.n += 1
        rid = f"r{self.n}"
        self.sim.pools[rid] = ReservationPool(rid, req(gpu_count=gpus), self.sim.now)

    @precondition(_a_live_pool)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        live = sorted(r for r, p in self.sim.pools.items() if not p.ended)
        rid = data.draw(st.sampled_from(live))
        self.sim.pools[rid] = replace(self.sim.pools[rid], ended=True)

    @precondition(_a_live_pool)
    @rule(data=st.data(), gpus=st.sampled_from([1, 2]))
    def arrive_inside(self, data: st.DataObject, gpus: int) -> None:
        live = sorted(r for r, p in self.sim.pools.items() if not p.ended)
        rid = data.draw(st.sampled_from(live))
        self.n += 1
        self.sim.submit(job(f"j{self.n}", gpu_count=gpus, reservation_id=rid, limit=20.0), 10.0)

    @rule(dt=st.sampled_from([1.0, 5.0, 20.0, 60.0]))
    def tick(self, dt: float) -> None:
        """Time passes (jobs end, victims leave), then a pass runs."""
        self.sim.advance(dt)
        self.schedule()

    @rule()
    def schedule(self) -> None:
        sim = self.sim
        pending, fleet, now = list(sim.pending.values()), sim.fleet(), sim.now
        unplaced = [q.as_job() for q in sim.pools.values() if q.worker is None and not q.ended]
        # a reservation waiting to be placed is a job in fleet order too (§8.3)
        ordered = in_order([*pending, *unplaced])
        head = ordered[0].task_id if ordered else None
        decision = sim.decide()
        inside = {j.task_id for j in pending if j.req.ext_ml_reservation_id is not None}
        self._reservations_kept(decision, inside)
        if sim.pools:  # the general checks, on the fleet with the reservations carved out
            pending = [j for j in pending if j.task_id not in inside]
            pending += [q.as_job() for q in sim.pools.values() if q.worker is None and not q.ended]
            fleet = open_queues(hold(fleet, sim.pools.values(), now))  # placing one is a job
        p = checks.Pass(pending, fleet, now, sim.policy, _general(decision, inside))
        checks.capacity_is_safe(p)
        checks.placement_is_right(p)
        checks.order_is_kept(p)
        checks.reservations_hold(p)
        self._first_starts_in_time(head, p)
        sim.apply(decision)
        if self.budget is not None:  # §10.3: the queue's budget peak never exceeds it
            held = sum(
                r.gpus for w in sim.workers.values() for r in w.running.values()
                if r.queue == "train"
            )  # fmt: skip
            assert held <= self.budget, f"train holds {held} GPUs, budget {self.budget}"

    @rule(depth=st.integers(1, 5))
    def quick_pass_agrees(self, depth: int) -> None:
        """`Policy.queue_depth` (the live leader's passes between full ones): the first
        `depth` jobs in order get exactly the full pass's decisions, and no job after
        them is decided or annotated. Nothing is applied."""
        sim = self.sim
        full = sim.decide()
        policy, sim.policy = sim.policy, replace(sim.policy, queue_depth=depth)
        try:
            quick = sim.decide()
        finally:
            sim.policy = policy
        pools = {r for r, q in sim.pools.items()}
        general = [j for j in sim.pending.values() if j.req.ext_ml_reservation_id not in pools]
        general += [q.as_job() for q in sim.pools.values() if q.worker is None and not q.ended]
        ordered = [j.task_id for j in in_order(general)]
        first, rest = set(ordered[:depth]), set(ordered[depth:])
        for name in ("assignments", "reservations", "preemptions"):
            got, want = set(getattr(quick, name)), set(getattr(full, name))
            assert got <= want, f"{name}: quick pass decided {got - want}"
            missing = {d for d in want - got if d.task_id in first}
            assert not missing, f"{name}: quick pass left out {missing}"
            assert not {d.task_id for d in got} & rest, f"{name}: decided past the depth"
        assert not set(quick.annotations) & rest, "annotated past the depth"

    @rule(depth=st.integers(1, 40))
    def settled_pass_agrees(self, depth: int) -> None:
        """`Policy.settle` (the live leader's quick passes): stopping where every job
        left can only wait changes no start, reservation, preemption or denial of the
        same pass without the stop; the jobs it left out are not annotated."""
        sim = self.sim
        kept = sim.policy
        try:
            sim.policy = replace(kept, queue_depth=depth)
            whole = sim.decide()
            sim.policy = replace(kept, queue_depth=depth, settle=True)
            settled = sim.decide()
        finally:
            sim.policy = kept
        for name in ("assignments", "reservations", "preemptions", "denials"):
            got, want = set(getattr(settled, name)), set(getattr(whole, name))
            assert got == want, f"{name}: the settled pass gave {got ^ want} differently"
        assert set(settled.annotations) <= set(whole.annotations)

    def _reservations_kept(self, decision: Decision, inside: set[str]) -> None:
        """§8.3: inside jobs go to their reservation's worker only, and fit it."""
        sim = self.sim
        placed = {a.task_id[len(PREFIX) :]: a.worker for a in decision.assignments
                  if a.task_id.startswith(PREFIX)}  # fmt: skip
        used: dict[str, int] = {}
        for w in sim.workers.values():
            for r in w.running.values():
                if r.reservation is not None:
                    used[r.reservation] = used.get(r.reservation, 0) + r.gpus
        for a in decision.assignments:
            if a.task_id not in inside:
                continue
            j = sim.pending[a.task_id]
            pool = sim.pools[str(j.req.ext_ml_reservation_id)]
            assert not pool.ended, f"{a.task_id} started in ended reservation {pool.rid}"
            assert a.worker == pool.worker, f"{a.task_id} ran outside reservation {pool.rid}"
            used[pool.rid] = used.get(pool.rid, 0) + int(j.req.ext_ml_gpu_count or 0)
            assert used[pool.rid] <= int(pool.req.ext_ml_gpu_count or 0), f"{pool.rid} overfull"
        for name, w in sim.workers.items():
            held = sum(
                max(0, int(p.req.ext_ml_gpu_count or 0) - used.get(p.rid, 0))
                for p in sim.pools.values()
                if not p.ended and (p.worker == name or placed.get(p.rid) == name)
            )
            busy = sum(r.gpus for r in w.running.values() if r.preempted_for is None)
            new = sum(
                int(sim.pending[a.task_id].req.ext_ml_gpu_count or 0)
                for a in decision.assignments
                if a.worker == name and a.task_id in sim.pending
            )
            assert busy + new + held <= w.caps.gpu_count + _leaving(w, decision), (
                f"{name}: {busy} running + {new} new + {held} reserved > {w.caps.gpu_count}"
            )

    def _first_starts_in_time(self, head: str | None, p: checks.Pass) -> None:
        if self.first is not None and self.first[0] != head:
            self.first = None  # it started, or a job ahead of it arrived or came back
        if head is None or head in p.decision.assigned():
            self.first = None
            return
        if self.first is not None and not p.preempting.get(head):
            assert p.now < self.first[1] + EPS, (
                f"{head} was to start by {self.first[1]} but waits at {p.now}"
            )
        start = next((r.start for r in p.decision.reservations if r.task_id == head), None)
        if start is None:
            return
        if self.first is not None:
            assert start <= self.first[1] + EPS, f"{head}'s reserved start moved later"
        else:
            self.first = (head, start)


def _general(decision: Decision, inside: set[str]) -> Decision:
    """The decision without the jobs inside reservations (placing one stays: it is a job)."""
    keep = tuple(a for a in decision.assignments if a.task_id not in inside)
    notes = {t: a for t, a in decision.annotations.items() if t not in inside}
    return replace(decision, assignments=keep, annotations=notes)


def _leaving(w: object, decision: Decision) -> int:
    """GPUs of victims planned in this pass (still running until they leave)."""
    running = getattr(w, "running", {})
    gone = {v for p in decision.preemptions for v in p.victims}
    return sum(r.gpus for t, r in running.items() if t in gone)


FleetMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTheFleetPolicyKeepsItsInvariants = FleetMachine.TestCase


def test_a_reservation_placed_ahead_of_the_first_job_may_take_its_reserved_start() -> None:
    """Found by the machine with 300 examples: a dynamic reservation (§8.3) created after a
    spot job got its reserved start is on-demand, so ahead of it in fleet order; placing it
    on that worker moves the spot job's start. The oracle counts waiting reservations as
    jobs in order (`schedule`), so this is no broken promise."""
    one, spot = {"share": 1.0, "queue": "celery", "gpu_affinity": "pack"}, "spot"
    state = FleetMachine()
    state.start(depth=1, profiles=["nvidia-a100x8"], budget=None)
    state.arrive(
        jobs=[{"gpu_count": 1, "priority_class": spot, "priority": 0, "limit": None, **one}]
    )
    state.schedule()
    state.reserve(gpus=2)
    state.reserve(gpus=2)
    state.arrive(
        jobs=[
            {"gpu_count": 1, "priority_class": spot, "priority": 0, "limit": None, **one},
            {"gpu_count": 1, "priority_class": spot, "priority": 2, "limit": 20.0, **one},
            {"gpu_count": 1, "priority_class": "on-demand", "priority": 0, "limit": None, **one},
            {"gpu_count": 1, "priority_class": "on-demand", "priority": 0, "limit": 5.0, **one},
        ]
    )
    state.arrive(
        jobs=[
            {"gpu_count": 1, "priority_class": spot, "priority": 0, "limit": None, **one},
            {"gpu_count": 1, "priority_class": spot, "priority": 0, "limit": None, **one},
            {"gpu_count": 1, "priority_class": spot, "priority": 1, "limit": None, **one},
            {"gpu_count": 1, "priority_class": "on-demand", "priority": 0, "limit": 20.0, **one},
        ]
    )
    state.arrive(
        jobs=[
            {"gpu_count": 1, "priority_class": "on-demand", "priority": 0, "limit": None, **one},
            {"gpu_count": 4, "priority_class": "on-demand", "priority": 0, "limit": 5.0, **one},
        ]
    )
    state.schedule()
    state.tick(dt=20.0)
    state.schedule()
    state.tick(dt=1.0)
    state.reserve(gpus=1)
    state.arrive(jobs=[{"gpu_count": 8, "priority_class": spot, "priority": 0, "limit": 5.0,
                        **{**one, "share": 0.14}}])  # fmt: skip
    state.tick(dt=60.0)
    assert state.sim.pools["r15"].worker == "w1", "the reservation was placed"
    state.teardown()
