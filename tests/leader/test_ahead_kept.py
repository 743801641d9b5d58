"""`leader.ahead_kept`: prefetch's per-worker results kept between passes equal the rules'
(`ahead.shown_running`, `ahead.room`) after any change, and are made again only for a
worker that changed."""

from __future__ import annotations

import dataclasses
from typing import Any

from celery_ojs_ml.leader import ahead
from celery_ojs_ml.leader.ahead import assigned_jobs, left_after, room, shown_running
from celery_ojs_ml.leader.ahead_kept import AheadKept
from celery_ojs_ml.scheduler import Decision, PendingJob, WorkerState
from celery_ojs_ml.scheduler.model import Assignment
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.testing.builders import worker_with


def _busy(name: str) -> WorkerState:
    state = WorkerState.of(name, worker_with(gpus=2))
    return dataclasses.replace(state, free=dataclasses.replace(state.free, gpus=0))


def _beat(*allocs: tuple[str, str]) -> dict[str, Any]:
    rows = [{"task_id": t, "band": b, "devices": [0], "preemptible": b == "spot"}
            for t, b in allocs]  # fmt: skip
    return {"free": {"allocations": rows}}


def _job(task_id: str) -> PendingJob:
    return PendingJob(task_id, normalize({"ext_ml_gpu_count": 1}).requirements, submitted_at=1.0)


def _check(kept: AheadKept, fleet: list[WorkerState], live: dict[str, Any], decision: Decision,
           jobs: dict[str, PendingJob]) -> None:  # fmt: skip
    shown = shown_running(fleet, live)
    assert kept.shown(fleet, live) == shown
    left = left_after(decision, fleet, jobs)
    assigned = assigned_jobs(decision, jobs)
    assert kept.room(fleet, left, assigned) == room(fleet, left, assigned, shown)
    for w in fleet:
        ids = {r.task_id for r in (*w.running, *shown.get(w.name, ()))}
        assert kept.running_ids(w) == ids


def test_kept_results_equal_the_rules_through_changes() -> None:
    kept = AheadKept()
    fleet = [_busy("a"), _busy("b"), _busy("c")]
    live = {"a": _beat(("x", "on-demand")), "b": _beat(("y", "spot")), "c": {}}
    _check(kept, fleet, live, Decision(), {})
    _check(kept, fleet, live, Decision(), {})  # nothing changed
    live = {**live, "a": _beat(("x", "on-demand"), ("z", "reserved"))}  # a new heartbeat
    _check(kept, fleet, live, Decision(), {})
    jobs = {"j": _job("j")}
    _check(kept, fleet, live, Decision(assignments=(Assignment("j", "b", 1.0),)), jobs)
    _check(kept, fleet, live, Decision(), {})  # the assignment is not kept
    fleet = [fleet[0], _busy("b"), _busy("d")]  # b remade, c gone, d new
    _check(kept, fleet, {**live, "d": _beat(("q", "spot"))}, Decision(), {})


def test_a_worker_is_looked_at_again_only_when_its_state_or_heartbeat_changed(
    monkeypatch: Any,
) -> None:
    made: list[str] = []
    real = ahead.shown_on

    def counted(w: WorkerState, snap: Any) -> Any:
        made.append(w.name)
        return real(w, snap)

    monkeypatch.setattr(ahead, "shown_on", counted)
    kept = AheadKept()
    fleet = [_busy("a"), _busy("b")]
    live = {"a": _beat(("x", "on-demand")), "b": {}}
    kept.shown(fleet, live)
    assert sorted(made) == ["a", "b"]
    kept.shown(fleet, {**live})  # the same snapshots, in a new mapping
    assert sorted(made) == ["a", "b"], "nothing changed: nothing made again"
    kept.shown([fleet[0], _busy("b")], {**live, "a": _beat(("x", "on-demand"))})
    assert sorted(made) == ["a", "a", "b", "b"]
