"""`bench/replay_gang.py`: a tiny gang replay under the scheduler and under pull."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.replay_gang import build, main, metrics, replay
from bench.replay_sim import Sim


def within_capacity(sim: Sim, started: list[str]) -> None:
    for w in sim.workers.values():
        assert sum(r.job.gpus for r in w.running.values()) <= w.gpus


def test_the_scheduler_starts_the_whole_fleet_gang_sooner_than_pull() -> None:
    """The 4x8 gang needs every GPU of the fleet at once: pull starts it only when the
    stream of 1-GPU jobs happens to leave every worker empty; the scheduler reserves."""
    workload = build(workers=4, small=100, gang_specs=["4x8", "2x4"], load=0.9, seed=3)
    waits = {}
    for policy in ("ojs", "pull"):
        sim, busy = replay(workload, policy, seed=3)
        m = metrics(sim, busy, workload)  # checks every gang's ranks started together
        assert sim.finished == len(workload.jobs)
        assert m["largest_gang"] == "g0-4x8"
        assert max(n for _, n in busy) <= 32
        waits[policy] = m["largest_gang_wait_s"]
    assert waits["ojs"] < waits["pull"]


def test_a_gang_runs_its_ranks_on_distinct_workers_at_once_under_both_policies() -> None:
    workload = build(workers=4, small=40, gang_specs=["3x4", "2x8"], load=0.9, seed=1)
    ranks = workload.of()
    for policy in ("ojs", "pull"):
        seen: dict[str, set[str]] = {}

        def observe(sim: Sim, started: list[str], seen: dict[str, set[str]] = seen) -> None:
            within_capacity(sim, started)
            for jid in started:
                if jid in ranks:
                    seen.setdefault(ranks[jid][0].gid, set()).add(sim.where[jid])

        replay(workload, policy, seed=1, observe=observe)
        assert {g: len(ws) for g, ws in seen.items()} == {"g0-3x4": 3, "g1-2x8": 2}


def test_the_replay_is_deterministic_by_seed() -> None:
    workload = build(workers=4, small=60, gang_specs=["4x8"], load=0.9, seed=5)
    again = build(workers=4, small=60, gang_specs=["4x8"], load=0.9, seed=5)
    assert workload.jobs == again.jobs
    for policy in ("ojs", "pull"):
        first = metrics(*replay(workload, policy, seed=5), workload)
        second = metrics(*replay(again, policy, seed=5), again)
        assert first == second


def test_the_plots_are_written(tmp_path: Path) -> None:
    """`--plot` of replay_gang, scheduler and replay_fair: a PNG each (bench extra)."""
    pytest.importorskip("matplotlib")
    from bench import replay_plot

    result = main(["--workers", "4", "--small", "30", "--gangs", "2x8", "--plot",
                   str(tmp_path / "gang.png")])  # fmt: skip
    assert result["ojs"]["largest_gang"] == "g0-2x8"
    rows = [
        {"workers": n, "fleet": f, "jobs": 10, "pass_s": 0.1 * n, "median_us": 5.0, "p99_us": 9.0}
        for n in (10, 100)
        for f in ("busy", "idle")
    ]
    replay_plot.scheduler_plot(rows, str(tmp_path / "scheduler.png"))
    windows = [{"t_h": 0.5 * k, "a_pct": 50.0, "b_pct": 50.0, "a_cum_pct": 60.0,
                "b_cum_pct": 40.0} for k in (1, 2)]  # fmt: skip
    run = {"target_pct": {"a": 50.0, "b": 50.0}, "windows": windows}
    fair = {
        "args": {"weights": ["1:1"], "half_life": 3600.0, "b_at": 1800.0},
        "runs": {"1:1 half-life 0s": run, "1:1 half-life 3600s": run},
    }
    replay_plot.fair_plot(fair, str(tmp_path / "fair.png"))
    for name in ("gang.png", "scheduler.png", "fair.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
