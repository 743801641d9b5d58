"""`leader.fleet_memo`: what the fleet view keeps between passes is made again exactly
when its source changed."""

from __future__ import annotations

from typing import Any

from celery_ojs_ml.leader.fleet_memo import CapsMemo, RunningMemo
from celery_ojs_ml.scheduler import RunningJob
from celery_ojs_ml.spec.normalize import normalize

_DOC = {"capabilities": {"accelerator": "gpu", "gpu": {"count": 4, "type": "nvidia-a100"}}}


def _made(log: list[str], name: str) -> RunningJob:
    log.append(name)
    req = normalize({"ext_ml_gpu_count": 1}).requirements
    return RunningJob.of(name, req, 1.0)


def test_capabilities_are_parsed_again_only_when_the_document_changes() -> None:
    memo = CapsMemo()
    first = memo.caps("w@h", {"capabilities": _DOC})
    assert memo.caps("w@h", {"capabilities": _DOC}) is first, "the same document object"
    copy: dict[str, Any] = {"capabilities": {**_DOC["capabilities"]}}
    assert memo.caps("w@h", {"capabilities": {**_DOC, **copy}}) is first, "an equal one"
    other = {"capabilities": {"accelerator": "gpu", "gpu": {"count": 8, "type": "nvidia-a100"}}}
    changed = memo.caps("w@h", {"capabilities": other})
    assert changed is not first and changed.gpu_count == 8


def test_a_worker_not_seen_in_a_pass_is_forgotten() -> None:
    memo = CapsMemo()
    first = memo.caps("w@h", {"capabilities": _DOC})
    memo.end_pass()
    memo.caps("v@h", {"capabilities": _DOC})
    memo.end_pass()
    assert memo.caps("w@h", {"capabilities": _DOC}) is not first


def test_a_running_job_is_made_again_when_its_lease_or_checkpoint_changes() -> None:
    memo, log = RunningMemo(), []
    headers = {"ext_ml_gpu_count": 1}
    lease = {"task_id": "t", "worker": "w@h", "started_at": 1.0, "devices": [0], "headers": headers}
    job = memo.running(lease, None, lambda: _made(log, "a"))
    assert memo.running({**lease}, None, lambda: _made(log, "b")) is job
    assert memo.running(lease, 5.0, lambda: _made(log, "c")) is not job, "a checkpoint"
    moved = {**lease, "worker": "v@h"}
    memo.running(moved, 5.0, lambda: _made(log, "d"))
    restarted = {**moved, "started_at": 2.0}
    memo.running(restarted, 5.0, lambda: _made(log, "e"))
    assert log == ["a", "c", "d", "e"]


def test_a_workers_state_is_kept_while_nothing_it_reads_changes() -> None:
    """Same heartbeat content and no assignment since: the same `WorkerState`; the ledger
    assigning there, or a new heartbeat, makes it again, with the new free capacity."""
    from celery_ojs_ml.allocator.model import Demand
    from celery_ojs_ml.capabilities import resolve_capabilities
    from celery_ojs_ml.leader.fleet_memo import fresh_memos
    from celery_ojs_ml.leader.fleet_view import worker_states

    caps = resolve_capabilities("profile:nvidia-a100x4").model_dump(mode="json")
    free = {"free": {"gpu_count": 3, "cpu_cores": 8, "memory_gb": 64}}
    beat = {"capabilities": caps, "free": free, "info": {"queues": ["celery"]}, "ts": 1.0}
    memos = fresh_memos()

    def parse(headers: Any) -> Any:
        return normalize(dict(headers)).requirements

    (first,) = worker_states({"w": beat}, [], {}, parse, memos)
    (again,) = worker_states({"w": {**beat, "ts": 2.0}}, [], {}, parse, memos)
    assert again is first, "a refresh that changed nothing"
    (assigned,) = worker_states({"w": beat}, [], {"w": Demand(gpus=2)}, parse, memos)
    assert assigned is not first and assigned.free.gpus == 1
    fewer = {"free": {"gpu_count": 1, "cpu_cores": 8, "memory_gb": 64}}
    (changed,) = worker_states({"w": {**beat, "free": fewer}}, [], {}, parse, memos)
    assert changed.free.gpus == 1


def test_a_workers_running_jobs_are_made_again_only_when_a_lease_or_its_heartbeat_changed() -> None:
    """`worker_states` keeps each worker's jobs from its leases; a new lease there, or a
    heartbeat that no longer shows a job, changes them."""
    from celery_ojs_ml.capabilities import resolve_capabilities
    from celery_ojs_ml.leader.fleet_memo import fresh_memos
    from celery_ojs_ml.leader.fleet_view import worker_states

    caps = resolve_capabilities("profile:nvidia-a100x4").model_dump(mode="json")
    allocations = [{"task_id": "a", "devices": [0]}, {"task_id": "b", "devices": [1]}]
    free = {"free": {"gpu_count": 2}, "allocations": allocations}
    beat = {"capabilities": caps, "free": free, "info": {"queues": ["celery"]}, "ts": 100.0}
    headers = {"ext_ml_gpu_count": 1}

    def lease(task_id: str) -> dict[str, Any]:
        return {"task_id": task_id, "worker": "w", "started_at": 50.0, "devices": [0],
                "headers": headers}  # fmt: skip

    def parse(found: Any) -> Any:
        return normalize(dict(found)).requirements

    memos = fresh_memos()
    leases = [lease("a"), lease("b")]
    (first,) = worker_states({"w": beat}, leases, {}, parse, memos)
    (again,) = worker_states({"w": beat}, list(leases), {}, parse, memos)
    assert again is first and [r.task_id for r in first.running] == ["a", "b"]
    (more,) = worker_states({"w": beat}, [*leases, lease("c")], {}, parse, memos)
    assert [r.task_id for r in more.running] == ["a", "b", "c"]
    assert [r.ended for r in more.running] == [False, False, True], "c not shown at 100 s"
    shows_a = {**free, "allocations": allocations[:1]}
    (ended,) = worker_states({"w": {**beat, "free": shows_a}}, leases, {}, parse, memos)
    assert [r.ended for r in ended.running] == [False, True], "b no longer shown"


def test_a_lease_is_parsed_once_though_its_worker_was_not_remade_for_passes() -> None:
    """A worker kept for a pass (nothing changed) keeps its leases' parsed jobs: when its
    heartbeat's time later changes, its jobs are made again from them, not parsed again."""
    from celery_ojs_ml.capabilities import resolve_capabilities
    from celery_ojs_ml.leader.fleet_memo import fresh_memos
    from celery_ojs_ml.leader.fleet_view import worker_states

    caps = resolve_capabilities("profile:nvidia-a100x4").model_dump(mode="json")
    free = {"free": {"gpu_count": 3}, "allocations": [{"task_id": "a", "devices": [0]}]}
    beat = {"capabilities": caps, "free": free, "info": {"queues": ["celery"]}, "ts": 100.0}
    leases = [{"task_id": "a", "worker": "w", "started_at": 50.0, "devices": [0],
               "headers": {"ext_ml_gpu_count": 1}}]  # fmt: skip
    parsed: list[Any] = []

    def parse(found: Any) -> Any:
        parsed.append(found)
        return normalize(dict(found)).requirements

    memos = fresh_memos()
    (first,) = worker_states({"w": beat}, leases, {}, parse, memos)
    worker_states({"w": beat}, leases, {}, parse, memos)  # kept: the lease is not asked for
    (later,) = worker_states({"w": {**beat, "ts": 101.0}}, leases, {}, parse, memos)
    assert len(parsed) == 1, "the lease was parsed again"
    assert later.running == first.running
    worker_states({"w": beat}, [], {}, parse, memos)  # the lease is gone: forgotten
    worker_states({"w": beat}, leases, {}, parse, memos)
    assert len(parsed) == 2


def test_allocated_ids_are_kept_per_snapshot_and_forgotten_with_their_worker() -> None:
    from celery_ojs_ml.leader.fleet_view import allocated_ids

    snap = {"allocations": [{"task_id": "a"}, {"task_id": "b"}]}
    kept: dict[str, Any] = {}
    first = allocated_ids({"w": {"free": snap}, "v": {}}, kept)
    assert first == {"w": frozenset({"a", "b"}), "v": frozenset()}
    again = allocated_ids({"w": {"free": snap, "ts": 2.0}}, kept)
    assert again["w"] is first["w"] and set(kept) == {"w"}, "kept; v forgotten"
    changed = allocated_ids({"w": {"free": {"allocations": [{"task_id": "c"}]}}}, kept)
    assert changed == {"w": frozenset({"c"})}
    assert allocated_ids({"w": {"free": snap}}) == {"w": frozenset({"a", "b"})}
