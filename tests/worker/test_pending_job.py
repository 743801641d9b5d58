"""A pending record with foreign `ojs_*` values still becomes a valid `PendingJob`: one
bad record must never stop the scheduler's passes (found by the header fuzz test)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.leader.fleet_memo import fresh_memos
from celery_ojs_ml.leader.fleet_view import pending_job
from celery_ojs_ml.spec.normalize import normalize


def _parse(headers: Any) -> Any:
    return normalize({"ext_ml_gpu_count": 1}).requirements


@pytest.mark.parametrize(
    ("band", "queue"), [("abc", "celery"), (None, ["x"]), (3, {"a": 1}), ("spot", "")]
)
def test_a_foreign_band_or_queue_is_recomputed_not_trusted(band: Any, queue: Any) -> None:
    record = {"meta": {"band": band, "queue": queue}, "msg": {"headers": {"ojs_band": band}}}
    job = pending_job("t", record, _parse)
    assert job is not None
    assert job.band in ("reserved", "on-demand", "spot")
    assert job.band == (band if band == "spot" else "on-demand")
    assert isinstance(job.queue, str) and job.queue


@pytest.mark.parametrize(
    ("reported", "gpus", "expected"),
    [(2, 4, 2), (3, 1, 1), (2, None, 2), (None, 4, None), (True, 4, None), (-1, 4, None),
     ("2", 4, None)],
)  # fmt: skip
def test_a_workers_reported_free_nvlink_island_is_read_safely(
    reported: Any, gpus: int | None, expected: int | None
) -> None:
    """A worker's `nvlink_free` (the most free devices that are all peers) is capped by its
    free GPUs less what was assigned since; a foreign value counts as not reported."""
    from celery_ojs_ml.leader.fleet_view import nvlink_free

    assert nvlink_free({"free": {"nvlink_free": reported}}, gpus) == expected


def test_the_heartbeats_free_island_reaches_the_schedulers_worker_state() -> None:
    """The allocator's snapshot (`nvlink_free`) travels in the heartbeat's `free`; the leader
    caps it by the GPUs it assigned there since (the ledger)."""
    from celery_ojs_ml.allocator.model import Demand
    from celery_ojs_ml.capabilities import resolve_capabilities
    from celery_ojs_ml.leader.fleet_view import worker_states

    caps = resolve_capabilities("profile:nvidia-a100x4").model_dump(mode="json")
    snapshot = {"free": {"gpu_count": 3, "cpu_cores": 8, "memory_gb": 64}, "nvlink_free": 3}
    live = {"w": {"capabilities": caps, "free": snapshot, "info": {"queues": ["celery"]}}}
    (state,) = worker_states(live, [], {}, _parse, fresh_memos())
    assert state.nvlink_free == 3 and state.free.gpus == 3
    (busier,) = worker_states(live, [], {"w": Demand(gpus=2)}, _parse, fresh_memos())
    assert busier.nvlink_free == 1 and busier.free.gpus == 1


def test_a_workers_free_processes_are_its_pools_less_its_allocations_and_the_ledger() -> None:
    """The heartbeat's `info.processes` (its pool's) less the jobs it reported allocated
    and the jobs assigned since (the ledger's count), below 0 when jobs wait in its
    pool's queue; none reported: not counted."""
    from celery_ojs_ml.capabilities import resolve_capabilities
    from celery_ojs_ml.leader.fleet_view import processes_free, worker_states

    caps = resolve_capabilities("profile:nvidia-a100x4").model_dump(mode="json")
    allocations = [{"task_id": "a"}, {"task_id": "b"}]
    snapshot = {"free": {"gpu_count": 2}, "allocations": allocations}
    info = {"queues": ["celery"], "processes": 3}
    live = {"w": {"capabilities": caps, "free": snapshot, "info": info}}
    (state,) = worker_states(live, [], {}, _parse, fresh_memos())
    assert state.free.processes == 1
    (busier,) = worker_states(live, [], {}, _parse, fresh_memos(), inflight_jobs={"w": 2})
    assert busier.free.processes == -1, "one of them will wait in the pool's queue"
    for foreign in (None, True, "3", 0, -1):
        assert processes_free({"info": {"processes": foreign}, "free": snapshot}, 0) is None
    # Plain Celery tasks running in the pool (`info.plain_running`) hold processes too.
    plain = {"free": snapshot, "info": {"processes": 3, "plain_running": 1}}
    assert processes_free(plain, 0) == 0
    for foreign in (None, True, "1", -1):
        odd = {"free": snapshot, "info": {"processes": 3, "plain_running": foreign}}
        assert processes_free(odd, 0) == 1, foreign


def test_a_job_held_ahead_at_a_gate_counts_in_its_queues_share_only_once_it_starts() -> None:
    """With fair-share weights every assignment is held against its queue until its lease
    shows (`budget_inflight`); one delivered ahead of capacity (`ojs_ml_prefetch`) waits
    at its worker's gate and holds no GPU, so it is counted from its start, not before
    (counting it made `infer` look as if it held GPUs it was only waiting for)."""
    from celery_ojs_ml.leader.budget_holds import BudgetHold, budget_inflight

    holds = {
        "ahead": BudgetHold("infer", 1, "w"),
        "assigned": BudgetHold("train", 2, "w"),
    }
    records = {t: {"state": "assigned", "worker": "w"} for t in holds}
    live = {"w": {"ts": 100.0}}
    waiting = budget_inflight(holds, records, [], live, {}, ahead={"ahead": "w"})
    assert waiting == [("train", 2)]
    assert set(holds) == {"ahead", "assigned"}, "the hold is kept for its start"
    # The gate started it (its record left the pending set) after the last heartbeat.
    del records["ahead"]
    started = budget_inflight(holds, records, [], live, {"ahead": 101.0}, ahead={"ahead": "w"})
    assert sorted(started) == [("infer", 1), ("train", 2)]


def test_a_lease_whose_job_the_workers_later_heartbeat_no_longer_shows_has_ended() -> None:
    """A job's lease is released with the worker's next lease batch, after the wake-up
    its release sends: the pass that wake-up starts must not count the ended job in its
    queue's holdings (its queue would look past its fair share). A heartbeat older than
    the job's start, or one that still shows it allocated, keeps it running."""
    from celery_ojs_ml.capabilities import resolve_capabilities
    from celery_ojs_ml.leader.fleet_view import worker_states
    from celery_ojs_ml.scheduler.fair import held_gpus

    caps = resolve_capabilities("profile:nvidia-a100x4").model_dump(mode="json")
    headers = {"ext_ml_gpu_count": 1}
    leases = [
        {"task_id": t, "worker": "w", "started_at": 100.0, "devices": [i], "headers": headers}
        for i, t in enumerate(("ended", "runs"))
    ]

    def running(ts: float, allocated: list[str]) -> set[str]:
        snapshot = {"free": {"gpu_count": 3}, "allocations": [{"task_id": t} for t in allocated]}
        live = {"w": {"capabilities": caps, "free": snapshot, "ts": ts, "info": {}}}
        (state,) = worker_states(live, leases, {}, _parse, fresh_memos())
        assert {r.task_id for r in state.running} == {"ended", "runs"}
        assert held_gpus([state]) == {"celery": len([r for r in state.running if not r.ended])}
        return {r.task_id for r in state.running if not r.ended}

    assert running(101.0, ["runs"]) == {"runs"}
    assert running(101.0, ["runs", "ended"]) == {"ended", "runs"}
    assert running(100.01, ["runs"]) == {"ended", "runs"}  # taken about when it started


def test_jobs_a_holder_started_under_a_grant_since_its_heartbeat_take_its_free_capacity() -> None:
    """A grant holder starts jobs without the scheduler (no assignment for the ledger to
    count): until its next heartbeat shows them, their leases take the GPUs, processes
    and NVLink island its last heartbeat showed free, so a job of another class is not
    sent where it no longer fits. A job the heartbeat shows, or one not sent under a
    grant (the ledger counts those), is not taken twice."""
    from celery_ojs_ml.capabilities import resolve_capabilities
    from celery_ojs_ml.leader.fleet_view import worker_states

    caps = resolve_capabilities("profile:nvidia-a100x4").model_dump(mode="json")
    snapshot = {
        "free": {"gpu_count": 2, "cpu_cores": 8, "memory_gb": 64},
        "nvlink_free": 2,
        "allocations": [{"task_id": "a"}, {"task_id": "b"}],
    }
    live = {"w": {"capabilities": caps, "free": snapshot, "ts": 100.0, "info": {"processes": 4}}}

    def lease(task_id: str, grant: bool) -> dict[str, Any]:
        headers = {"ext_ml_gpu_count": 1, **({"ojs_grant": "e1"} if grant else {})}
        return {"task_id": task_id, "worker": "w", "started_at": 100.5, "devices": [2]} | {
            "headers": headers
        }

    (seen,) = worker_states(live, [lease("a", True), lease("b", True)], {}, _parse, fresh_memos())
    assert (seen.free.gpus, seen.nvlink_free, seen.free.processes) == (2, 2, 2)
    (late,) = worker_states(live, [lease("a", True), lease("c", True)], {}, _parse, fresh_memos())
    assert (late.free.gpus, late.nvlink_free, late.free.processes) == (1, 1, 1)
    (assigned,) = worker_states(
        live, [lease("a", True), lease("c", False)], {}, _parse, fresh_memos()
    )
    assert (assigned.free.gpus, assigned.nvlink_free) == (2, 2)
