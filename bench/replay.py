"""Replay the Alibaba GPU trace (2023, "openb") through the scheduler's pure policy core.

Two modes (methodology in docs/performance.md, "Trace replay"):

* `--mode fgd`: the GPU allocation rate at 80-130% arrived load on the 1,213-node
  cluster, FGD's own methodology, for `random`, `bestfit` and `ojs` (the
  project's `scheduler.score.placement`), mean of `--seeds` seeds, on the
  default, gpuspec33 and multigpu50 workloads.
* `--mode time`: a scaled cluster over time (`bench/replay_time.py`).

    .venv/bin/python bench/replay.py --mode fgd [--seeds 10] [--json] [--plot FILE.png]
    .venv/bin/python bench/replay.py --mode time [--json] [--plot FILE.png]

Runs use `--jobs` processes (default: the CPU count).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import replay_fgd, replay_time
from bench.trace import WORKLOADS, load_nodes, load_pods
from celery_ojs_ml.allocator.sharing import FULL

POLICIES = ("random", "bestfit", "ojs")
PAPER = {  # hkust-adsl/kubernetes-scheduler-simulator, analysis_allo_discrete.csv, 10 seeds
    "default": {"random": 87.47, "bestfit": 93.08, "fgd": 95.39},
    "gpuspec33": {"random": 86.46, "bestfit": 93.09, "fgd": 94.55},
    "multigpu50": {"random": 90.27, "bestfit": 95.74, "fgd": 97.18},
}
FGD_BY_LOAD = {  # the same file, FGD's row at 80, 90, ... 130 % arrived load
    "default": (80.02, 89.98, 95.23, 95.30, 95.35, 95.39),
    "gpuspec33": (73.44, 80.61, 87.84, 94.43, 94.50, 94.55),
    "multigpu50": (80.02, 89.93, 97.09, 97.12, 97.15, 97.18),
}


def fgd_run(args: tuple[str, str, int, str]) -> tuple[str, str, int, dict[str, float], float]:
    """One replay: (workload, policy, seed, order) -> rates by load, seconds taken."""
    workload, policy, seed, order = args
    start = time.perf_counter()
    nodes, pods = load_nodes(), load_pods(workload)
    pods.sort(key=lambda p: p.name)  # the artifact starts from the pods sorted by name
    rng = random.Random(seed)
    capacity = sum(n.gpus for n in nodes) * FULL
    replay = replay_fgd.workload(pods, capacity, rng, order)
    rank = list(range(len(nodes)))
    rng.shuffle(rank)  # the artifact's random node names: the tie-break order
    choose: replay_fgd.Chooser
    if policy == "random":
        choose = replay_fgd.random_policy(rng)
    elif policy == "bestfit":
        choose = replay_fgd.bestfit_policy
    else:
        choose = replay_fgd.project_policy(replay_fgd.workload_of(pods, nodes))
    rates = replay_fgd.run(nodes, replay, choose, rank)
    return workload, policy, seed, rates, time.perf_counter() - start


def fgd_mode(opts: argparse.Namespace) -> dict[str, Any]:
    """Every (workload, policy, seed) run, in parallel; means by load."""
    runs = [
        (w, p, seed, opts.order)
        for w in opts.workloads
        for p in opts.policies
        for seed in range(opts.seeds)
    ]
    with multiprocessing.Pool(opts.jobs) as pool:
        done = pool.map(fgd_run, runs, chunksize=1)
    out: dict[str, Any] = {}
    for w in opts.workloads:
        out[w] = {}
        for p in opts.policies:
            rates = [r for (ww, pp, _, r, _) in done if (ww, pp) == (w, p)]
            out[w][p] = {
                load: round(statistics.fmean(r[load] for r in rates), 2) for load in rates[0]
            }
    return out


def print_fgd(result: dict[str, Any], seconds: float) -> None:
    for workload, by_policy in result.items():
        loads = list(next(iter(by_policy.values())))
        print(f"\n{workload}: GPU allocation rate (%) by arrived load (%)")
        print(f"{'policy':<10}" + "".join(f"{load:>8}" for load in loads) + "   paper@130")
        for policy, rates in by_policy.items():
            paper = PAPER[workload].get(policy)
            cells = "".join(f"{rates[load]:>8.2f}" for load in loads)
            print(f"{policy:<10}{cells}   {paper if paper is not None else '-'}")
        fgd = "".join(f"{r:>8.2f}" for r in FGD_BY_LOAD[workload][: len(loads)])
        print(f"{'FGD paper':<10}{fgd}")
    print(f"\n{seconds:.0f} s in all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("fgd", "time"), default="fgd")
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--order", choices=("shuffle", "creation"), default="shuffle")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", metavar="FILE.png")
    replay_time.add_arguments(parser)
    opts = parser.parse_args(argv)
    start = time.perf_counter()
    if opts.mode == "time":
        result = replay_time.main(opts)
    else:
        result = fgd_mode(opts)
        if not opts.json:
            print_fgd(result, time.perf_counter() - start)
    if opts.json:
        print(json.dumps(result, indent=2))
    if opts.plot:
        from bench import replay_plot

        replay_plot.plot(opts.mode, result, opts.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
