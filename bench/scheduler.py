"""Fleet policy core benchmark: decision time per job, 10,000 pending, 100 to 10,000 workers.

One pass of `celery_ojs_ml.scheduler` over a simulated fleet built from the
capability profiles (A100x8, H100x8, A100x2, L40Sx4, L4x1, T4x1, CPU), each
worker its own `Capabilities` with its own `worker_id`, as the registry would
hold them. Two fleets per size:

* busy: every worker runs jobs up to 60-100% of its GPUs, with time limits
  (10% without), so most pending jobs wait and get a reservation or estimate;
* idle: nothing runs, so the pass fills the fleet first.

Each `Planner.decide` is timed on its own (median, p99 per decision); the
pass total adds setting up the fleet view and annotating every waiting job.
Target: median <= 1 ms per decision at 1,000 workers. `--memory` runs one more
pass under tracemalloc and reports its peak (the pass's own allocations, on
top of the inputs); `digest` is a hash of the pass's decision (assignments,
reservations, preemptions, start estimates, annotations), equal before and after
a change that must not change decisions. `--profile N` prints cProfile's top N
functions of one pass. Memory: `rss_mb` is the process's resident set right after
the timed pass (fleet, pending jobs, memo and the pass's decision alive: what a
leader holding them would hold), `max_rss_mb` its peak so far (over earlier rows
too). `--plot FILE.png` draws the pass time and the time per decision against
the number of workers (log x); `--out FILE.json` writes the rows.

    .venv/bin/python bench/scheduler.py [--jobs 10000] [--workers 100 1000]
        [--fleets busy idle] [--memory] [--profile 25] [--json] [--plot FILE.png]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import random
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from celery_ojs_ml.capabilities import Capabilities, resolve_capabilities
from celery_ojs_ml.leader.gc_pause import gc_paused
from celery_ojs_ml.scheduler import (
    Decision,
    Memo,
    PendingJob,
    Planner,
    Policy,
    RunningJob,
    WorkerState,
)
from celery_ojs_ml.scheduler.order import in_order
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.wire.settings import OJSMLSettings

NOW = 1_700_000_000.0
LIVE = Policy(estimate_depth=OJSMLSettings().estimate_depth)
"""The policy core's defaults with the live leader's estimate depth."""
PROFILES = (
    ("profile:nvidia-a100x8", 3),
    ("profile:nvidia-h100x8", 2),
    ("profile:nvidia-a100x2", 2),
    ("profile:nvidia-l40sx4", 1),
    ("profile:nvidia-l4x1", 3),
    ("profile:nvidia-t4x1", 2),
    ("profile:cpu", 1),
)
JOB_KINDS: tuple[tuple[dict[str, Any], int], ...] = (
    ({"gpu_count": 1}, 30),
    ({"gpu_count": 1, "gpu_type": "nvidia-a100", "gpu_memory_gb": 80}, 10),
    ({"gpu_count": 2, "cpu_cores": 8, "memory_gb": 64}, 10),
    ({"gpu_count": 4, "gpu_interconnect": "nvlink"}, 10),
    ({"gpu_count": 8, "gpu_type": "nvidia-h100"}, 5),
    ({"cpu_cores": 4, "memory_gb": 16}, 15),
    ({"gpu_count": 1, "gpu_type": "nvidia-l4", "model_id": "llama-3.1-8b"}, 10),
    ({"gpu_count": 1, "precision": "bf16"}, 10),
)
BANDS = (("spot", 3), ("on-demand", 5), ("reserved", 2))


def req(**attrs: Any) -> MLRequirements:
    return normalize({f"ext_ml_{k}": v for k, v in attrs.items()}).requirements


def weighted(rng: random.Random, table: Sequence[tuple[Any, int]]) -> Any:
    return rng.choices([x for x, _ in table], weights=[w for _, w in table])[0]


def fleet(n: int, rng: random.Random, *, busy: bool) -> list[WorkerState]:
    base = {p: resolve_capabilities(p) for p, _ in PROFILES}
    out = []
    for i in range(n):
        name = f"worker-{i:04d}"
        caps = base[weighted(rng, PROFILES)].model_copy(update={"worker_id": name})
        running = running_jobs(caps, name, rng) if busy else []
        out.append(WorkerState.of(name, caps, running))
    return out


def running_jobs(caps: Capabilities, name: str, rng: random.Random) -> list[RunningJob]:
    gpus = caps.gpu_count
    target = round(gpus * rng.uniform(0.6, 1.0)) if gpus else 0
    jobs: list[RunningJob] = []
    used = 0
    while used < target:
        size = min(rng.choice((1, 1, 2, 4)), target - used)
        band = weighted(rng, BANDS)
        limit = None if rng.random() < 0.1 else float(rng.randrange(600, 7200, 60))
        started = NOW - rng.uniform(0, limit or 3600)
        jobs.append(
            RunningJob(
                f"{name}-r{len(jobs)}",
                band,
                started,
                gpus=size,
                time_limit_s=limit,
                preemptible=band == "spot",
                last_checkpoint_at=started + 60 if rng.random() < 0.5 else None,
            )
        )
        used += size
    return jobs


def pending(n: int, rng: random.Random) -> list[PendingJob]:
    kinds = [(req(**attrs), w) for attrs, w in JOB_KINDS]
    out = []
    for i in range(n):
        r = weighted(rng, kinds)
        limit = None if rng.random() < 0.1 else float(rng.randrange(300, 7200, 60))
        out.append(
            PendingJob(
                f"job-{i:05d}",
                r,
                priority=rng.randrange(10),
                submitted_at=NOW - n + i,
                time_limit_s=limit,
                band=weighted(rng, BANDS),
                gpu_affinity="spread" if rng.random() < 0.1 else "pack",
            )
        )
    return out


def digest(decision: Decision) -> str:
    """A short hash of what a pass decided (identical decisions, identical digest)."""
    parts = [
        sorted((a.task_id, a.worker) for a in decision.assignments),
        sorted((r.task_id, r.worker, r.start) for r in decision.reservations),
        sorted((t, a.reason_pending, a.t_estimate) for t, a in decision.annotations.items()),
        sorted((p.task_id, p.worker, p.victims) for p in decision.preemptions),
        sorted((r.task_id, r.worker, r.start) for r in decision.planned),
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def one_pass(
    workers: list[WorkerState], jobs: list[PendingJob], memo: Memo, policy: Policy = LIVE
) -> tuple[list[int], float, dict[str, Any]]:
    """Per-decision times (ns), the pass total (s), and the outcome counts."""
    start = time.perf_counter()
    with gc_paused():  # as the leader runs a pass (leader/gc_pause.py)
        ordered = in_order(jobs)
        planner = Planner(workers, NOW, policy, pending=ordered, memo=memo)
        samples = []
        for job in ordered:
            t0 = time.perf_counter_ns()
            planner.decide(job)
            samples.append(time.perf_counter_ns() - t0)
        t0 = time.perf_counter_ns()
        planner.finish()  # the jobs deferred (scheduler.defer): one sample for them all
        samples.append(time.perf_counter_ns() - t0)
        decision = planner.decision()
    total = time.perf_counter() - start
    counts = {
        "assigned": len(decision.assignments),
        "reserved": len(decision.reservations),
        "preempting": len(decision.preemptions),
        "estimated": sum(1 for a in decision.annotations.values() if a.t_estimate is not None),
        "waiting": len(decision.annotations),
        "digest": digest(decision),
    }
    return samples, total, counts


def quick_pass(
    workers: list[WorkerState], ordered: list[PendingJob], memo: Memo, depth: int, policy: Policy
) -> float:
    """Seconds of a pass between full ones: the leader's window hands the core the first
    `4 x depth` jobs of the last ordering (leader/pass_inputs.py, scheduler/window.py)
    and it decides the first `depth` (`ojs_ml_queue_depth`) over the whole fleet."""
    window = ordered[: 4 * depth]
    start = time.perf_counter()
    with gc_paused():
        planner = Planner(workers, NOW, policy, pending=window, memo=memo)
        for job in window[:depth]:
            planner.decide(job)
        planner.decision()
    return time.perf_counter() - start


def run(
    n_workers: int, n_jobs: int, *, busy: bool, seed: int = 7, memory: bool = False,
    profile: int = 0, policy: Policy = LIVE,
) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(seed)
    workers, jobs = fleet(n_workers, rng, busy=busy), pending(n_jobs, rng)
    memo = Memo()
    one_pass(workers, jobs, memo, policy)  # warm: capability keys and "ever" answers
    samples, total, counts = one_pass(workers, jobs, memo, policy)
    samples.sort()
    depth = OJSMLSettings().queue_depth
    quick = min(quick_pass(workers, in_order(jobs), memo, depth, policy) for _ in range(3))
    extra: dict[str, Any] = {
        "rss_mb": psutil.Process(os.getpid()).memory_info().rss / 2**20,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if memory:
        tracemalloc.start()
        one_pass(workers, jobs, memo, policy)
        extra["pass_peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    if profile:
        prof = cProfile.Profile()
        prof.runcall(one_pass, workers, jobs, memo, policy)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(profile)
    return {
        "workers": n_workers,
        "fleet": "busy" if busy else "idle",
        "jobs": n_jobs,
        "median_us": statistics.median(samples) / 1000,
        "p99_us": samples[int(0.99 * (len(samples) - 1))] / 1000,
        "max_us": samples[-1] / 1000,
        "pass_s": total,
        "per_job_us": total / n_jobs * 1e6,
        "quick_pass_s": quick,
        **counts,
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--fleets", nargs="+", choices=("busy", "idle"), default=["busy", "idle"])
    parser.add_argument("--memory", action="store_true", help="tracemalloc peak of one pass")
    parser.add_argument("--profile", type=int, default=0, help="cProfile: top N functions")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", metavar="FILE.png", help="pass and decision time vs workers")
    parser.add_argument("--out", metavar="FILE.json", help="write the rows as JSON")
    parser.add_argument(
        "--estimate-depth", type=int, default=LIVE.estimate_depth,
        help="ojs_ml_estimate_depth (the live default); -1: estimate every blocked job",
    )  # fmt: skip
    args = parser.parse_args()
    depth = None if args.estimate_depth < 0 else args.estimate_depth
    policy = replace(LIVE, estimate_depth=depth)
    rows = []
    for n in args.workers:
        for kind in args.fleets:
            row = run(
                n, args.jobs, busy=kind == "busy", memory=args.memory, profile=args.profile,
                policy=policy,
            )  # fmt: skip
            rows.append({**row, "estimate_depth": depth})
            if not args.json:
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from bench.replay_plot import scheduler_plot

        scheduler_plot(rows, args.plot)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print_table(rows)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'workers':>7} {'fleet':>5} {'median':>9} {'p99':>9} {'max':>9} {'pass':>8}"
    print(head + "  quick   assigned reserved preempting estimated waiting")
    for r in rows:
        print(
            f"{r['workers']:>7} {r['fleet']:>5} {r['median_us']:>7.1f}us {r['p99_us']:>7.1f}us"
            f" {r['max_us']:>7.0f}us {r['pass_s']:>7.2f}s {r['quick_pass_s'] * 1000:>6.0f}ms"
            f"   {r['assigned']:>8} {r['reserved']:>8}"
            f" {r['preempting']:>10} {r['estimated']:>9} {r['waiting']:>7}"
            f"  rss {r['rss_mb']:.0f} MB (max {r['max_rss_mb']:.0f})"
            + (f" pass peak {r['pass_peak_mb']:.0f} MB" if "pass_peak_mb" in r else "")
            + f" {r['digest']}"
        )
    print("target: median <= 1000 us per decision at 1,000 workers")


if __name__ == "__main__":
    main()
