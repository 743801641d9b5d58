"""Random fleets over time: arrivals, completions, worker joins and losses, preemptions.

After every pass: capacity safety (DESIGN invariant 1), no wrong placement
(2), band order (4, rule 1) and the backfill rule (7: every reservation still
fits at its start beside every job that could still be there). Across passes:
the job first in fleet order starts by the first reserved start it was given
(7, no starvation), as long as it stays first and no worker is lost. With a
`train` budget (§10.3), the queue never holds more GPUs than its budget.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from celery_ojs_ml.scheduler import Budget, Policy, in_order
from tests.scheduler import checks
from tests.scheduler.helpers import caps, job
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
).map(lambda d: {**d.pop("kind"), **d})


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

    @precondition(lambda self: len(self.sim.workers) < 5)
    @rule(profile=st.sampled_from(PROFILES))
    def join(self, profile: str) -> None:
        self.n += 1
        queues = frozenset({"celery", "train"}) if self.n % 3 == 0 else frozenset({"celery"})
        self.sim.workers[f"w{self.n}"] = SimWorker(caps(profile), queues=queues)

    @precondition(lambda self: len(self.sim.workers) > 1)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        self.sim.lose(data.draw(st.sampled_from(sorted(self.sim.workers))))
        self.first = None  # the reserved capacity may be gone

    @precondition(lambda self: len(self.sim.pending) < 25)
    @rule(jobs=st.lists(JOBS, min_size=1, max_size=4))
    def arrive(self, jobs: list[dict[str, Any]]) -> None:
        for spec in jobs:
            self.n += 1
            duration = (spec["limit"] or 300.0) * spec.pop("share")
            self.sim.submit(job(f"j{self.n}", **spec), duration)

    @rule(dt=st.sampled_from([1.0, 5.0, 20.0, 60.0]))
    def tick(self, dt: float) -> None:
        """Time passes (jobs end, victims leave), then a pass runs."""
        self.sim.advance(dt)
        self.schedule()

    @rule()
    def schedule(self) -> None:
        sim = self.sim
        pending, fleet, now = list(sim.pending.values()), sim.fleet(), sim.now
        head = in_order(pending)[0].task_id if pending else None
        decision = sim.decide()
        p = checks.Pass(pending, fleet, now, sim.policy, decision)
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


FleetMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTheFleetPolicyKeepsItsInvariants = FleetMachine.TestCase
