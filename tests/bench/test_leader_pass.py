"""`bench/leader_pass.py`: a tiny run of the live leader's pass, its reads checked as it runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.leader_pass import PHASES, leading, main, same
from bench.leader_pass_fleet import HOUR_S, Workers, fleet
from celery_ojs_ml.leader.loop import FleetScheduler
from celery_ojs_ml.scheduler.model import Assignment, Decision
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.pending import STARTED, PendingBook


@pytest.mark.parametrize(
    ("start", "stem", "running"), [(True, "leader_pass", 4), (False, "leader_pass_unstarted", 2)]
)
def test_a_tiny_run_times_every_phase_and_the_feeds_read_what_the_full_reads_do(
    redis_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    start: bool,
    stem: str,
    running: int,
) -> None:
    argv = ["--workers", "4", "20", "--jobs", "200", "--passes", "3", "--rounds", "3"]
    argv += ["--start" if start else "--no-start"]
    found = main([*argv, "--redis-url", redis_url, "--out", str(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out) == found
    assert json.loads((tmp_path / f"{stem}.json").read_text()) == found
    rows = (tmp_path / f"{stem}.md").read_text().splitlines()
    assert (tmp_path / "leader_pass.png").read_bytes()[:4] == b"\x89PNG", "the plot"
    assert found["scenario"] in rows[0]
    assert [s["workers"] for s in found["sizes"]] == [4, 20]
    for size in found["sizes"]:
        n = size["workers"]
        passes = size["passes"]
        assert {k: v["count"] for k, v in passes.items()} == {"full": 1, "quick": 2}
        for kind, row in passes.items():
            assert set(PHASES) <= set(row)
            assert all(0.0 <= row[p]["median"] <= row[p]["max"] for p in PHASES)
            assert any(r.startswith(f"| {n} | {kind} | ") for r in rows)
        # every worker runs 4 of its 8 GPUs: the first pass fills the rest, two jobs each;
        # started, they leave the ledger; never started, they stay in it
        assert (size["first_pass_assigned"], size["later_assigned"]) == (2 * n, 0)
        assert (size["started"], size["ledger"]) == ((2 * n, 0) if start else (0, 2 * n))
        reads = size["reads"]
        assert reads["equal"] and (reads["workers"], reads["leases"]) == (n, running * n)
        # one worker changed per round: its heartbeat and its leases are read again, the
        # refreshed ones are not
        assert (reads["reread_workers"], reads["reread_leases"]) == (1, running)


def _pass(leader: FleetScheduler) -> Decision:
    decision = leader.schedule_once()
    leader.link.settle()
    return decision


def _assert_started(side: Workers, assignments: tuple[Assignment, ...]) -> None:
    """Each job started as its gate would: record started, a lease, its GPUs advertised."""
    book = PendingBook(side.store)
    leases = {x["task_id"]: x for x in LeaseBook(side.store, HOUR_S).all()}
    live = side.store.live_workers()
    for a in assignments:
        record = book.get(a.task_id)
        assert record is None or record["state"] == STARTED
        assert leases[a.task_id]["worker"] == a.worker
        assert a.task_id in {x["task_id"] for x in live[a.worker]["free"]["allocations"]}
    for name in live:
        devices = [d for x in leases.values() if x["worker"] == name for d in x["devices"]]
        assert sorted(devices) == list(range(8))  # full, and no GPU leased twice


def _end_one(side: Workers, worker: str) -> None:
    """One of `worker`'s jobs ends: its GPUs freed, its lease released, a heartbeat sent."""
    lease = side.leases[worker].pop(0)
    side.allocators[worker].free(lease["task_id"])
    LeaseBook(side.store, HOUR_S).release(lease["task_id"], lease["token"])
    side.beats[worker]["free"] = side.allocators[worker].snapshot()
    side.advertise([worker])


def test_started_assignments_leave_the_ledger_and_no_job_is_assigned_twice(
    redis_url: str,
) -> None:
    with fleet(redis_url, 4, 40, 0.01, 0.25) as side, leading(redis_url, side.prefix) as leader:
        book = PendingBook(side.store)
        first = _pass(leader)
        assert len(first.assignments) == len(leader.ledger.entries) == 8
        assert side.start(first.assignments) == 8
        _assert_started(side, first.assignments)
        assert len(book.records()) == 40 - 8
        side.tick()
        second = _pass(leader)  # a full fleet: nothing to place, nothing in flight
        assert second.assignments == () and leader.ledger.entries == {}
        worker = next(n for n in sorted(side.beats) if n not in side.busier)
        _end_one(side, worker)
        third = _pass(leader)  # only the GPUs that freed are filled
        assert [a.worker for a in third.assignments] == [worker]
        assert side.start(third.assignments) == 1
        side.tick()
        _pass(leader)
        # what stays in flight is only what prefetch sent ahead to that worker's gate
        for task_id, entry in leader.ledger.entries.items():
            record = book.get(task_id) or {}
            assert (entry.worker, record.get("state")) == (worker, "assigned")
    ids = [a.task_id for d in (first, second, third) for a in d.assignments]
    assert len(ids) == len(set(ids)) == 9
    assert not set(ids) & set(leader.ledger.entries)


def test_a_start_the_pending_set_does_not_hold_stops_the_run(redis_url: str) -> None:
    with fleet(redis_url, 1, 4, 0.01, 0.1) as side, leading(redis_url, side.prefix) as leader:
        first = _pass(leader)
        wrong = [Assignment(a.task_id, "gpu-9999@fleet", a.score) for a in first.assignments]
        with pytest.raises(RuntimeError, match="is not assigned to gpu-9999@fleet"):
            side.start(wrong)
        assert side.start(first.assignments) == 2
        with pytest.raises(RuntimeError, match="not assigned"):
            side.start(first.assignments)  # started already: no assigned record left


def _lease(task_id: str, deadline: float, **extra: Any) -> dict[str, Any]:
    return {"task_id": task_id, "worker": "w", "token": "t", **extra, "deadline": deadline}


def test_a_feed_read_that_differs_from_the_full_read_stops_the_run() -> None:
    full = {"a": _lease("a", 100.0), "b": _lease("b", 100.0)}
    same(full, {"a": _lease("a", 100.0005), "b": _lease("b", 100.0)}, "deadline", "leases", 0.002)
    with pytest.raises(RuntimeError, match="missing"):
        same(full, {"a": _lease("a", 100.0)}, "deadline", "leases", 0.002)
    with pytest.raises(RuntimeError, match="differs"):
        same(full, {"a": _lease("a", 100.0), "b": _lease("b", 101.0)}, "deadline", "leases", 0.002)
    with pytest.raises(RuntimeError, match="differs"):
        same(
            full,
            {"a": _lease("a", 100.0, devices=[1]), "b": full["b"]},
            "deadline",
            "leases",
            0.002,
        )
