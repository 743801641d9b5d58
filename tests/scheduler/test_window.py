"""The leader's window (`scheduler.window`): passes between full ones decide the first
`queue_depth` jobs in fleet order without ordering the whole backlog.

The property: whenever `Window.pick` answers, the first `depth` jobs in order
(after escalation, §8.4) of what it picked are the first `depth` of every waiting
job; when it cannot tell, it answers None and the leader orders everything again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_ojs_ml.scheduler import PendingJob, in_order
from celery_ojs_ml.scheduler.escalate import escalate_all
from celery_ojs_ml.scheduler.window import Window, always_decided
from tests.scheduler.helpers import job

BANDS = ("spot", "on-demand", "reserved")
ESCALATES = {
    "priority_escalation": True,
    "escalation_after_s": 30,
    "escalation_target_class": "reserved",
}


def _job(n: int, band: int, priority: int, at: float, escalates: bool) -> PendingJob:
    extra: dict[str, Any] = dict(ESCALATES) if escalates and band == 0 else {}
    return job(f"j{n}", at=at, priority=priority, gpu_count=1, priority_class=BANDS[band], **extra)


_SPEC = st.tuples(
    st.integers(0, 2), st.integers(0, 3), st.integers(0, 50), st.booleans()
)  # band, priority, submit time, escalates
_OP = st.tuples(st.sampled_from(["admit", "assign", "start", "back", "prio", "tick"]), _SPEC)


class _Leader:
    """What the live leader keeps between passes, reduced to the window's inputs."""

    def __init__(self, specs: list[tuple[int, int, int, bool]], size: int) -> None:
        self.jobs: dict[str, PendingJob] = {}
        self.state: dict[str, str] = {}
        self.fresh: set[str] = set()
        self.size = size
        self.now = 100.0
        for spec in specs:
            self.admit(spec)
        self.window = self.rebuild()

    def admit(self, spec: tuple[int, int, int, bool]) -> None:
        n = len(self.jobs)
        self.jobs[f"j{n}"] = _job(n, spec[0], spec[1], float(spec[2]), spec[3])
        self.state[f"j{n}"] = "pending"

    def records(self) -> dict[str, dict[str, str]]:
        return {i: {"state": s} for i, s in self.state.items()}

    def waiting(self, ids: Any = None) -> list[PendingJob]:
        ids = self.state if ids is None else ids
        return [self.jobs[i] for i in ids if self.state.get(i) == "pending"]

    def rebuild(self) -> Window:
        self.fresh = set()
        return Window.of(in_order(self.waiting()), list(self.state), self.size)

    def apply(self, op: str, spec: tuple[int, int, int, bool]) -> None:
        pending = [i for i, s in self.state.items() if s == "pending"]
        assigned = [i for i, s in self.state.items() if s == "assigned"]
        pick = spec[2]
        if op == "admit":
            self.admit(spec)
        elif op == "assign" and pending:
            self.state[pending[pick % len(pending)]] = "assigned"
        elif op == "start" and assigned:
            del self.state[assigned[pick % len(assigned)]]
        elif op == "back" and assigned:  # a gate gives it back: its record is marked changed
            self.state[(i := assigned[pick % len(assigned)])] = "pending"
            self.fresh.add(i)
        elif op == "prio" and pending:  # prioritize: a new priority, marked changed
            i = pending[pick % len(pending)]
            self.jobs[i] = replace(self.jobs[i], priority=(spec[1] - 2) * 5)
            self.fresh.add(i)
        elif op == "tick":
            self.now += spec[2]


def _first(jobs: list[PendingJob], now: float, depth: int) -> list[str]:
    escalated, _ = escalate_all(jobs, now)
    return [j.task_id for j in in_order(escalated)[:depth]]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_SPEC, min_size=0, max_size=40),
    st.lists(_OP, max_size=60),
    st.integers(1, 6),
    st.integers(1, 4),
)
def test_the_window_picks_the_first_jobs_in_order_or_says_it_cannot(
    specs: list[tuple[int, int, int, bool]],
    ops: list[tuple[str, tuple[int, int, int, bool]]],
    depth: int,
    per_depth: int,
) -> None:
    leader = _Leader(specs, depth * per_depth)
    for op, spec in ops:
        leader.apply(op, spec)
        picked = leader.window.pick(leader.records(), leader.fresh, depth)
        if picked is None:  # the leader orders everything again
            leader.window = leader.rebuild()
            continue
        assert len(picked) == len(set(picked)), "a job picked twice"
        want = _first(leader.waiting(), leader.now, depth)
        got = _first(leader.waiting(picked), leader.now, depth)
        assert got == want, (op, picked)


def test_a_job_outside_the_window_that_changed_is_picked() -> None:
    jobs = [job(f"j{n}", at=float(n), gpu_count=1) for n in range(10)]
    window = Window.of(in_order(jobs), [j.task_id for j in jobs], 3)
    records = {j.task_id: {"state": "pending"} for j in jobs}
    picked = window.pick(records, {"j9"}, 2)
    assert picked is not None and set(picked) == {"j0", "j1", "j2", "j9"}


def test_a_new_job_is_picked_and_a_window_that_ran_out_says_so() -> None:
    jobs = [job(f"j{n}", at=float(n), gpu_count=1) for n in range(10)]
    window = Window.of(in_order(jobs), [j.task_id for j in jobs], 3)
    records: dict[str, dict[str, str]] = {j.task_id: {"state": "pending"} for j in jobs}
    records["new"] = {"state": "pending"}
    assert set(window.pick(records, set(), 3) or ()) == {"j0", "j1", "j2", "new"}
    records["j0"]["state"] = records["j1"]["state"] = "assigned"
    assert window.pick(records, set(), 2) is None, "one window job left for a depth of 2"


def test_gang_ranks_reservation_jobs_and_escalating_jobs_are_always_decided() -> None:
    assert always_decided(replace(job("g", gpu_count=1), gang="g1"))
    assert always_decided(job("r", gpu_count=1, reservation_id="res-1"))
    assert always_decided(job("e", gpu_count=1, priority_class="spot", **ESCALATES))
    assert not always_decided(job("plain", gpu_count=1, priority_class="spot"))


def test_a_window_job_that_changed_does_not_count_as_one_still_in_place() -> None:
    """j0 is lowered below every job outside the window: with one unchanged window job left
    for a depth of 2, the window cannot tell the second job in order (it is j2)."""
    jobs = [job(f"j{n}", at=float(n), gpu_count=1) for n in range(6)]
    window = Window.of(in_order(jobs), [j.task_id for j in jobs], 2)
    records = {j.task_id: {"state": "pending"} for j in jobs}
    assert window.pick(records, {"j0"}, 2) is None
