"""`bench/leader_pass.py`: a tiny run of the live leader's pass, its reads checked as it runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.leader_pass import PHASES, main, same


def test_a_tiny_run_times_every_phase_and_the_feeds_read_what_the_full_reads_do(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--workers", "4", "20", "--jobs", "200", "--passes", "3", "--rounds", "3"]
    found = main([*argv, "--redis-url", redis_url, "--out", str(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out) == found
    assert json.loads((tmp_path / "leader_pass.json").read_text()) == found
    rows = (tmp_path / "leader_pass.md").read_text().splitlines()
    assert [s["workers"] for s in found["sizes"]] == [4, 20]
    for size in found["sizes"]:
        n = size["workers"]
        passes = size["passes"]
        assert {k: v["count"] for k, v in passes.items()} == {"full": 1, "quick": 2}
        for kind, row in passes.items():
            assert set(PHASES) <= set(row)
            assert all(0.0 <= row[p]["median"] <= row[p]["max"] for p in PHASES)
            assert any(r.startswith(f"| {n} | {kind} | ") for r in rows)
        # every worker runs 4 of its 8 GPUs: the first pass fills the rest, two jobs each
        assert size["first_pass_assigned"] == 2 * n
        reads = size["reads"]
        assert reads["equal"] and (reads["workers"], reads["leases"]) == (n, 2 * n)
        # one worker changed per round: its heartbeat and its two leases are read again,
        # the refreshed ones are not
        assert (reads["reread_workers"], reads["reread_leases"]) == (1, 2)


def _lease(task_id: str, deadline: float, **extra: Any) -> dict[str, Any]:
    return {"task_id": task_id, "worker": "w", "token": "t", **extra, "deadline": deadline}


def test_a_feed_read_that_differs_from_the_full_read_stops_the_run() -> None:
    full = {"a": _lease("a", 100.0), "b": _lease("b", 100.0)}
    same(full, {"a": _lease("a", 100.0005), "b": _lease("b", 100.0)}, "deadline", "leases")
    with pytest.raises(RuntimeError, match="missing"):
        same(full, {"a": _lease("a", 100.0)}, "deadline", "leases")
    with pytest.raises(RuntimeError, match="differs"):
        same(full, {"a": _lease("a", 100.0), "b": _lease("b", 101.0)}, "deadline", "leases")
    with pytest.raises(RuntimeError, match="differs"):
        same(full, {"a": _lease("a", 100.0, devices=[1]), "b": full["b"]}, "deadline", "leases")
