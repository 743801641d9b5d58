"""`Policy.settle` on random GPU fleets: a pass that stops where every job left can only
wait decides exactly what the same pass without the stop decides (`scheduler.settle`).

The fleet state machine (`test_state_machine.settled_pass_agrees`) mixes in CPU jobs,
GPU shares and reservations, under which the stop is mostly off; here every job needs
whole GPUs, so the stop happens and is checked on most examples."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_ojs_ml.scheduler import Policy, schedule
from tests.scheduler.helpers import NOW, job, running, worker

PROFILES = ("nvidia-a100x8", "nvidia-a100x2", "nvidia-l4x1")
SIZES = {"nvidia-a100x8": 8, "nvidia-a100x2": 2, "nvidia-l4x1": 1}
BANDS = ("spot", "on-demand", "reserved")
LIMITS = (None, 5.0, 60.0, 600.0)

RUNNING = st.fixed_dictionaries(
    {
        "gpus": st.sampled_from([1, 1, 2, 4]),
        "band": st.sampled_from(BANDS),
        "age": st.sampled_from([1.0, 30.0, 600.0]),
        "limit": st.sampled_from(LIMITS),
    }
)
WORKER = st.tuples(st.sampled_from(PROFILES), st.lists(RUNNING, max_size=6))
PENDING = st.fixed_dictionaries(
    {
        "gpus": st.sampled_from([1, 1, 1, 2, 4, 8]),
        "band": st.sampled_from(BANDS),
        "limit": st.sampled_from(LIMITS),
        "affinity": st.sampled_from(["pack", "pack", "spread", "dedicated"]),
    }
)


def _fleet(specs: list[tuple[str, list[dict[str, Any]]]]) -> list[Any]:
    fleet = []
    for n, (profile, jobs) in enumerate(specs):
        room, busy = SIZES[profile], []
        for k, r in enumerate(jobs):
            if r["gpus"] > room:
                continue
            room -= r["gpus"]
            busy.append(running(f"w{n}r{k}", gpu_count=r["gpus"], started=NOW - r["age"],
                                limit=r["limit"], band=r["band"],
                                preemptible=r["band"] == "spot"))  # fmt: skip
        fleet.append(worker(f"w{n}", profile, jobs=busy))
    return fleet


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(WORKER, min_size=1, max_size=4),
    pending=st.lists(PENDING, min_size=1, max_size=30),
    depth=st.sampled_from([0, 1, 2]),
)
def test_a_settled_pass_decides_what_the_whole_pass_decides(
    specs: list[tuple[str, list[dict[str, Any]]]], pending: list[dict[str, Any]], depth: int
) -> None:
    fleet = _fleet(specs)
    jobs = [
        job(
            f"j{i}",
            at=float(i),
            gpu_count=p["gpus"],
            priority_class=p["band"],
            limit=p["limit"],
            gpu_affinity=p["affinity"],
        )
        for i, p in enumerate(pending)
    ]
    policy = Policy(reservation_depth=depth, min_runtime_before_preemption_s=10.0)
    whole = schedule(jobs, fleet, NOW, policy)
    settled = schedule(jobs, fleet, NOW, replace(policy, settle=True))
    for name in ("assignments", "reservations", "preemptions", "denials"):
        got, want = set(getattr(settled, name)), set(getattr(whole, name))
        assert got == want, f"{name}: {got ^ want}"
    assert set(settled.annotations) <= set(whole.annotations)
