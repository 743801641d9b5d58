"""Prefetch on a worker whose jobs end before their leases are written.

A busy worker writes a job's lease some milliseconds after its start, so the passes
never see a short job in the leases: only its worker's heartbeat shows it allocated
(`leader.ahead.shown_running`). Those jobs count as running for `room` and for
`Prefetch._turning`; and the jobs right behind the one a pass sends ahead, of its
class, follow it there (`Prefetch._follow_on`), up to `ojs_ml_prefetch`.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from types import SimpleNamespace
from typing import Any

from celery import Celery

from celery_ojs_ml.allocator.model import rank
from celery_ojs_ml.leader.ahead import follows, left_after, next_waiting, room, shown_running
from celery_ojs_ml.leader.budget_holds import BudgetHolds
from celery_ojs_ml.leader.fleet_view import pending_job
from celery_ojs_ml.leader.loop import batches
from celery_ojs_ml.leader.notes import Notes
from celery_ojs_ml.leader.pass_state import PassState
from celery_ojs_ml.leader.prefetch import Batched, Prefetch
from celery_ojs_ml.scheduler import (
    Decision,
    PendingJob,
    Policy,
    Reservation,
    WorkerState,
    schedule,
)
from celery_ojs_ml.scheduler.model import Assignment
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.testing.builders import worker_with
from celery_ojs_ml.wire.batch import batching_tasks


def _job(task_id: str, at: float, band: str = "on-demand", gpus: int = 1, **kw: Any) -> PendingJob:
    spec: dict[str, Any] = {"ext_ml_gpu_count": gpus, "ext_ml_priority_class": band, **kw}
    return PendingJob(task_id, normalize(spec).requirements, submitted_at=at)


def _busy(name: str = "w", gpus: int = 1) -> WorkerState:
    """A worker with no lease to show and every GPU taken (by its heartbeat)."""
    state = WorkerState.of(name, worker_with(gpus=gpus))
    return dataclasses.replace(state, free=dataclasses.replace(state.free, gpus=0))


def _live(*allocs: tuple[str, str, list[int]], name: str = "w", **extra: Any) -> dict[str, Any]:
    """A heartbeat showing these (task id, band, devices) allocated."""
    rows = [{"task_id": t, "band": b, "devices": d, "preemptible": False, **extra}
            for t, b, d in allocs]  # fmt: skip
    return {name: {"free": {"allocations": rows}}}


class _Leader:
    """A `Prefetch` whose deliveries succeed and are recorded in `sent`."""

    def __init__(
        self,
        prefetch: int = 2,
        weights: tuple[tuple[str, float], ...] = (),
        batched: Batched = lambda job, live: False,
    ) -> None:
        self.sent: list[str] = []
        settings = SimpleNamespace(prefetch=prefetch, max_hold_s=30.0)
        policy = Policy(weights=weights)
        self.prefetch: Any = Prefetch(
            settings, policy, SimpleNamespace(annotate=lambda *a, **k: None), self._deliver,
            BudgetHolds(policy), Notes(None), lambda headers: None,  # type: ignore[arg-type]
            lambda t, r: pending_job(t, r, self.prefetch.parse), batched,
        )  # fmt: skip

    def _deliver(self, state: Any, task_id: str, *args: Any, **kwargs: Any) -> bool:
        self.sent.append(task_id)
        state.records[task_id]["state"] = "assigned"
        return True

    def send(
        self,
        decision: Decision,
        jobs: dict[str, PendingJob],
        live: dict[str, Any],
        now: float,
        fleet: list[WorkerState] | None = None,
    ) -> list[str]:
        """One pass's `send_ahead`; the jobs it delivered."""
        records: dict[str, dict[str, Any]] = {t: {"state": "pending"} for t in jobs}
        for task_id, worker in self.prefetch.sent.items():
            records[task_id] = {"state": "assigned", "worker": worker}
        state = PassState(now, records=records, live=live, fleet=fleet or [_busy()], jobs=jobs)
        state.decision = decision
        before = len(self.sent)
        self.prefetch.send_ahead(state)
        return self.sent[before:]


def test_a_job_its_heartbeat_shows_without_a_lease_counts_as_running_for_room() -> None:
    fleet = [_busy()]
    left = left_after(Decision(), fleet, {})
    assert room(fleet, left) == {}, "nothing known running: no room (as before)"
    shown = shown_running(fleet, _live(("a", "on-demand", [0])))
    assert [r.task_id for r in shown["w"]] == ["a"]
    below, frees = room(fleet, left, shown=shown)["w"]
    assert frees == 1 and below > rank("reserved"), "nothing preemptible runs there"


def test_a_job_only_a_heartbeat_shows_is_never_taken_for_an_old_one() -> None:
    """The heartbeat's `started_at` is on the worker's monotonic clock (seconds since
    boot, a small number): read as the scheduler's epoch clock it would make a job that
    started milliseconds ago look days old, old enough to preempt at once (§8.2's
    minimum run time). Planned on, the shown spot job is young and is not preempted."""
    fleet = [WorkerState.of("w", worker_with(gpus=1))]
    shown = shown_running(fleet, _live(("s", "spot", [0]), preemptible=True, started_at=12.5))
    (job,) = shown["w"]
    now = 1_700_000_000.0
    assert job.started_at > now, "not started yet on the scheduler clock"
    busy = [dataclasses.replace(fleet[0], running=(job,), free=_busy().free)]
    decision = schedule([_job("r", now, band="reserved")], busy, now, Policy())
    assert decision.preemptions == () and decision.assignments == ()
    assert decision.annotations["r"].t_estimate is None, "no start known: no estimate"
    old = dataclasses.replace(job, started_at=now - 3600)  # the same job, seen an hour ago
    aged = [dataclasses.replace(busy[0], running=(old,))]
    assert schedule([_job("r", now, band="reserved")], aged, now, Policy()).preemptions


def test_a_preemptible_or_unnamed_band_in_a_heartbeat_lowers_the_rank_a_job_may_have() -> None:
    """A job ranked above a preemptible running job may preempt it, which only a pass
    plans: the heartbeat's preemptible spot job, and an allocation whose band it does not
    name (taken as the lowest band, preemptible), keep such jobs from waiting ahead."""
    fleet = [_busy()]
    left = left_after(Decision(), fleet, {})
    spot = shown_running(fleet, _live(("s", "spot", [0]), preemptible=True))
    assert room(fleet, left, shown=spot) == {"w": (rank("spot"), 1)}
    odd = shown_running(fleet, _live(("o", "gold", [0])))
    assert room(fleet, left, shown=odd) == {"w": (rank("spot"), 1)}


def test_a_gpu_share_or_a_job_with_a_lease_is_not_counted_from_the_heartbeat() -> None:
    fleet = [_busy()]
    left = left_after(Decision(), fleet, {})
    share = shown_running(fleet, _live(("s", "on-demand", [0]), gpu_milli=500))
    assert room(fleet, left, shown=share) == {}, "a share frees no whole GPU"
    leased = WorkerState.of("w", worker_with(gpus=1), _busy_running("a"))
    assert shown_running([leased], _live(("a", "on-demand", [0]))) == {}


def _busy_running(task_id: str) -> list[Any]:
    from celery_ojs_ml.scheduler import RunningJob

    return [RunningJob(task_id, "on-demand", started_at=90.0, gpus=1)]


def test_a_pass_sends_the_next_job_ahead_when_the_heartbeat_shows_the_jobs_turning() -> None:
    """No lease ever shows the worker's jobs; a heartbeat showing another job than the
    last pass saw means one ended, so the next job goes ahead."""
    leader = _Leader()
    jobs = {"j": _job("j", 1.0)}
    plan = Decision(reservations=(Reservation("j", "w", None),))
    assert leader.send(plan, jobs, _live(("a", "on-demand", [0])), 100.0) == []
    assert leader.send(plan, jobs, _live(("b", "on-demand", [0])), 100.1) == ["j"]


def _turning(leader: _Leader) -> None:
    """Two passes seeing another job run on `w`: it is turning."""
    leader.send(Decision(), {}, _live(("a", "on-demand", [0])), 99.0)
    leader.send(Decision(), {}, _live(("b", "on-demand", [0])), 99.5)


def test_the_jobs_of_its_class_right_behind_a_job_sent_ahead_follow_it_up_to_prefetch() -> None:
    jobs = {t: _job(t, at) for t, at in (("j", 1.0), ("k", 2.0), ("l", 3.0), ("m", 4.0))}
    plan = Decision(reservations=(Reservation("j", "w", None),))
    leader = _Leader(prefetch=3)
    _turning(leader)
    assert leader.send(plan, jobs, _live(("b", "on-demand", [0])), 100.0) == ["j", "k", "l"]
    assert set(leader.prefetch.sent) == {"j", "k", "l"}
    assert leader.send(plan, jobs, _live(("b", "on-demand", [0])), 100.1) == [], "3 held"


def test_no_job_follows_past_a_job_of_another_class_or_band_waiting_before_it() -> None:
    """Fleet order holds at the gate: a job that would pass a waiting job ahead of it in
    order is not sent, nor one of another class (the core may place it elsewhere)."""
    plan = Decision(reservations=(Reservation("j", "w", None),))
    two = {"j": _job("j", 1.0), "x": _job("x", 2.0, gpus=2), "k": _job("k", 3.0)}
    leader = _Leader(prefetch=4)
    _turning(leader)
    assert leader.send(plan, two, _live(("b", "on-demand", [0]), name="w"), 100.0,
                       [_busy(gpus=2)]) == ["j"]  # fmt: skip
    higher = {"j": _job("j", 1.0, band="spot"), "r": _job("r", 5.0, band="reserved")}
    assert next_waiting(Decision(), higher) == {"r": "j"}, "bands first in fleet order"
    assert not follows(higher["j"], higher["r"])


def test_no_job_follows_where_another_worker_could_run_its_class() -> None:
    """There, a worker that frees first takes the next job still waiting, before the ones
    held at the first: only the planned job goes ahead, as before. A worker that is not
    available, or does not consume the queue, does not count."""
    plan = Decision(reservations=(Reservation("j", "w", None),))
    jobs = {"j": _job("j", 1.0), "k": _job("k", 2.0)}
    live = {**_live(("b", "on-demand", [0])), **_live(name="v")}
    for other, want in (
        (_busy("v"), ["j"]),
        (dataclasses.replace(_busy("v"), available=False), ["j", "k"]),
        (dataclasses.replace(_busy("v"), queues=frozenset({"batch"})), ["j", "k"]),
    ):
        leader = _Leader(prefetch=4)
        _turning(leader)
        assert leader.send(plan, jobs, live, 100.0, [_busy(), other]) == want, other


def test_a_job_placed_by_more_than_its_class_does_not_follow() -> None:
    first = _job("j", 1.0)
    assert follows(first, _job("k", 2.0))
    assert not follows(first, dataclasses.replace(_job("k", 2.0), gpu_affinity="spread"))
    assert not follows(first, _job("k", 2.0, band="spot"))


def test_jobs_assigned_by_the_pass_are_not_followers() -> None:
    jobs = {"a": _job("a", 0.5), "j": _job("j", 1.0), "k": _job("k", 2.0)}
    decision = Decision(assignments=(Assignment("a", "w", 1.0),))
    assert next_waiting(decision, jobs) == {"j": "k"}


def test_with_fair_share_weights_no_job_follows() -> None:
    """The core orders by share then; a job sent ahead is checked against its queue's
    share one by one (`AheadShares`), so only planned jobs go."""
    jobs = {"j": _job("j", 1.0), "k": _job("k", 2.0)}
    plan = Decision(reservations=(Reservation("j", "w", None),))
    leader = _Leader(prefetch=4, weights=(("celery", 1.0),))
    _turning(leader)
    assert "k" not in leader.send(plan, jobs, _live(("b", "on-demand", [0])), 100.0)


def test_the_jobs_of_a_task_that_batches_do_not_follow() -> None:
    """They reach their worker by its grant and its own queue, where a batch fills up to
    its max_size (worker/batching.py); followed on a prefetch window at a time, they ran
    in batches of two (bench/batching.py: 57 requests/s against 520)."""
    jobs = {t: _job(t, at) for t, at in (("j", 1.0), ("k", 2.0), ("l", 3.0))}
    plan = Decision(reservations=(Reservation("j", "w", None),))
    leader = _Leader(prefetch=3, batched=lambda job, live: True)
    _turning(leader)
    assert leader.send(plan, jobs, _live(("b", "on-demand", [0])), 100.0) == ["j"]


def _app() -> Celery:
    """An app that declares `serve` batched, `single` batched one by one, `train`
    plain, and `broken` with a bad declaration."""
    app = Celery("follow", set_as_current=False)
    declared: dict[str, dict[str, Any]] = {
        "serve": {"ml_batch": {"max_size": 8, "max_wait_ms": 5}},
        "single": {"ml_batch": {"max_size": 1}},
        "train": {},
        "broken": {"ml_batch": {"max_size": 0}},
    }
    for name, options in declared.items():
        app.task(name=name, shared=False, **options)(_echo)
    return app


def _echo(x: int) -> int:
    return x


def _typed(task: str) -> PendingJob:
    return dataclasses.replace(_job(task, 1.0), labels={"job_type": task})


def test_a_job_batches_when_its_task_declares_ml_batch_in_the_app() -> None:
    app = _app()
    assert batches(app, _typed("serve"), {})
    assert not batches(app, _typed("train"), {})
    assert not batches(app, _typed("single"), {}), "max_size 1 runs requests one by one"
    assert not batches(app, _typed("broken"), {}), "a bad declaration batches nothing"
    assert not batches(app, _typed("never-imported"), {})
    assert not batches(app, _job("unnamed", 1.0), {})


def test_a_job_batches_when_a_live_worker_advertises_its_task_as_batching() -> None:
    """The leader's process need not import the serving module: a worker's heartbeat
    names its tasks that batch (`info.batching`), as the worker's own rule decides."""
    app = Celery("leader", set_as_current=False)
    live = {"w": {"info": {"batching": ["serve"]}}, "v": {"info": {"queues": ["celery"]}}}
    assert batches(app, _typed("serve"), live)
    assert not batches(app, _typed("train"), live)
    assert not batches(app, _typed("serve"), {}), "no worker left that advertises it"
    assert batching_tasks(_app().tasks) == ["serve"], "max_size 1 and bad ones do not batch"


def test_a_corrupt_or_foreign_batching_advertisement_counts_for_nothing() -> None:
    app = Celery("leader", set_as_current=False)
    for found in ("serve", {"serve": True}, [b"serve", 7, None], 3, None):
        live: dict[str, Any] = {"w": {"info": {"batching": found}}}
        assert not batches(app, _typed("serve"), live), found
    for entry in ("junk", {"info": "junk"}, {"info": None}, {}):
        assert not batches(app, _typed("serve"), {"w": entry}), entry  # type: ignore[dict-item]
    mixed: dict[str, Any] = {"w": {"info": {"batching": [7, "serve"]}}}
    assert batches(app, _typed("serve"), mixed), "the names among the junk still count"


def test_the_jobs_of_a_task_only_a_live_worker_declares_batching_do_not_follow() -> None:
    """With `leader.loop.batches` wired as the leader does, for a task its process never
    imported: without the advertisement the next jobs follow, with it only the planned
    job goes."""
    serve = {"job_type": "serve"}
    jobs = {
        t: dataclasses.replace(_job(t, at), labels=serve)
        for t, at in (("j", 1.0), ("k", 2.0), ("l", 3.0))
    }
    plan = Decision(reservations=(Reservation("j", "w", None),))
    app = Celery("leader", set_as_current=False)
    for advertised, want in ((["serve"], ["j"]), (["other"], ["j", "k", "l"])):
        leader = _Leader(prefetch=3, batched=partial(batches, app))
        _turning(leader)
        live = _live(("b", "on-demand", [0]))
        live["w"]["info"] = {"batching": advertised}
        assert leader.send(plan, jobs, live, 100.0) == want, advertised
