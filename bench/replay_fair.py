"""Two tenants, one floods first: each one's GPU share over time, with and without memory.

    .venv/bin/python -m bench.replay_fair [--json] [--half-life 1800] [--weights 1:1 2:1]
        [--plot FILE.png]

Tenant `a` submits a backlog of 1-GPU jobs at t = 0 and fills the fleet; tenant
`b` submits a backlog as large at `--b-at` (1 h). Both backlogs outlast the run,
so both queues compete from then on. Job run times are uniform 300-900 s (seeded),
with exact time limits. The fleet is `--workers` workers of 8 GPUs.

The dispatch is `bench/replay_sim.py`'s `ojs` (the project's `schedule()` at every
event) with `ojs_ml_fair_share` weights, once without memory and once with
`ojs_ml_fair_share_half_life_s`: the usage is `scheduler.usage.Usage`, advanced at
every pass with the GPUs each queue holds, as the live leader does
(`leader.fair_usage`). Reported per policy, in windows of `--step` seconds: each
tenant's share of the GPUs held (time-weighted), and the cumulative share of
GPU-seconds since t = 0, against the weights' target while both wait. `--plot`
draws both against time, one column per weighting, with and without memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
from collections.abc import Callable
from typing import Any

from bench.replay_sim import Core, Job, Sim, Worker
from celery_ojs_ml.capabilities import resolve_capabilities
from celery_ojs_ml.scheduler import Policy, schedule
from celery_ojs_ml.scheduler.usage import Usage

TENANTS = ("a", "b")


def fleet(workers: int) -> list[Worker]:
    """`workers` workers of 8 x A100 (80 GB host memory, 64 cores)."""
    caps = resolve_capabilities("profile:nvidia-a100x8")
    out = []
    for i in range(workers):
        named = caps.model_copy(update={"worker_id": f"w{i}"})
        out.append(Worker(f"w{i}", 8, 64.0, 512.0, named))
    return out


def jobs(gpus: int, horizon: float, b_at: float, seed: int) -> list[Job]:
    """Backlogs for both tenants that outlast `horizon`: `a` at 0, `b` at `b_at`."""
    rng = random.Random(seed)
    out: list[Job] = []
    per = int(gpus * horizon / 300) + gpus  # more work than the fleet can run by the end
    for tenant, at in (("a", 0.0), ("b", b_at)):
        for i in range(per):
            duration = rng.uniform(300, 900)
            out.append(Job(f"{tenant}{i}", len(out), at + i * 1e-3, 1, 1.0, 1.0, "on-demand",
                           duration, queue=tenant))  # fmt: skip
    return out


def dispatch(
    core: Core, policy: Policy, trace: list[tuple[float, dict[str, int]]]
) -> Callable[[Sim], None]:
    """`schedule()` at every event with fair-share weights; with a half-life the decayed
    usage is advanced at every pass (held since the last pass), then after its starts."""
    usage = Usage(policy.fair_share_half_life_s)

    def run(sim: Sim) -> None:
        nonlocal usage
        usage = usage.advance(sim.now, {q: float(n) for q, n in sim.held.items()})
        pending = core.pending(sim, sim.waiting.values())
        decision = schedule(pending, core.fleet(sim), sim.now, policy, memo=core.memo,
                            usage=usage.mean_gpus())  # fmt: skip
        for a in decision.assignments:
            sim.start(a.task_id, a.worker)
        usage = usage.advance(sim.now, {q: float(n) for q, n in sim.held.items()})
        trace.append((sim.now, dict(sim.held)))

    return run


def replay(opts: argparse.Namespace, weights: dict[str, float], half_life: float) -> dict[str, Any]:
    """One run until `--horizon`; the share per window and cumulative."""
    workers = fleet(opts.workers)
    gpus = 8 * opts.workers
    sim = Sim(workers, jobs(gpus, opts.horizon, opts.b_at, opts.seed), seed=opts.seed)
    sim._push(opts.horizon, "stop", "", 0)  # an event that ends the run
    policy = Policy(
        weights=tuple(sorted(weights.items())),
        fair_share_half_life_s=half_life,
        queue_depth=4 * gpus,  # as the leader's quick passes: same decisions for these
    )
    trace: list[tuple[float, dict[str, int]]] = []
    run = dispatch(Core(), policy, trace)

    def until_horizon(s: Sim) -> None:
        if s.now < opts.horizon:
            run(s)
        else:
            s._events.clear()  # stop: the backlogs outlast the run

    with contextlib.suppress(AssertionError):  # `Sim.check`: this run stops at the horizon
        sim.run(until_horizon)
    return shares(trace, opts, gpus, weights)


def shares(
    trace: list[tuple[float, dict[str, int]]], opts: argparse.Namespace, gpus: int,
    weights: dict[str, float],
) -> dict[str, Any]:  # fmt: skip
    """Time-weighted share of the fleet each tenant held per window, and cumulative."""
    edges = [opts.step * k for k in range(int(opts.horizon / opts.step) + 1)]
    window = {t: [0.0] * (len(edges) - 1) for t in TENANTS}
    cumulative = {t: 0.0 for t in TENANTS}
    points: list[dict[str, Any]] = []
    for (t0, held), (t1, _) in zip(trace, [*trace[1:], (opts.horizon, {})], strict=True):
        for k in range(len(edges) - 1):
            overlap = max(0.0, min(t1, edges[k + 1]) - max(t0, edges[k]))
            for tenant in TENANTS:
                window[tenant][k] += overlap * held.get(tenant, 0)
        for tenant in TENANTS:
            cumulative[tenant] += (t1 - t0) * held.get(tenant, 0)
    running = {t: 0.0 for t in TENANTS}
    for k in range(len(edges) - 1):
        for tenant in TENANTS:
            running[tenant] += window[tenant][k]
        total = sum(running.values()) or 1.0
        points.append({
            "t_h": edges[k + 1] / 3600,
            **{f"{t}_pct": round(100 * window[t][k] / (gpus * opts.step), 1) for t in TENANTS},
            **{f"{t}_cum_pct": round(100 * running[t] / total, 1) for t in TENANTS},
        })  # fmt: skip
    w = sum(weights.get(t, 1.0) for t in TENANTS)
    target = {t: round(100 * weights.get(t, 1.0) / w, 1) for t in TENANTS}
    return {"target_pct": target, "windows": points}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--horizon", type=float, default=6 * 3600.0)
    parser.add_argument("--b-at", type=float, default=3600.0)
    parser.add_argument("--step", type=float, default=1800.0)
    parser.add_argument("--half-life", type=float, default=1800.0)
    parser.add_argument("--weights", nargs="+", default=["1:1", "2:1"], help="a:b weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", metavar="FILE.png", help="each tenant's share over time")
    opts = parser.parse_args(argv)
    result: dict[str, Any] = {"args": vars(opts), "runs": {}}
    for spec in opts.weights:
        wa, wb = (float(x) for x in spec.split(":"))
        weights = {"a": wa, "b": wb}
        for half_life in (0.0, opts.half_life):
            name = f"{spec} half-life {half_life:g}s"
            result["runs"][name] = replay(opts, weights, half_life)
    if opts.plot:
        from bench.replay_plot import fair_plot

        fair_plot(result, opts.plot)
    if opts.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    """One table per run: per window, each tenant's share of the fleet and cumulative."""
    for name, run in result["runs"].items():
        print(f"\n{name}  (target a/b while both wait: {run['target_pct']})")
        print("  t (h) | a % | b % | a cum % | b cum %")
        for p in run["windows"]:
            print(f"  {p['t_h']:5.1f} | {p['a_pct']:4.0f} | {p['b_pct']:4.0f} "
                  f"| {p['a_cum_pct']:7.1f} | {p['b_cum_pct']:7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
