"""`bench/replay.py --mode time`: three dispatch policies over time on a scaled cluster.

Modelling (the engine and the policies are in `bench/replay_sim.py`):

* **Cluster.** `--time-workers` (16) nodes of the trace's GPU node list, drawn
  with the seed; of up to 500 draws the first whose GPU total is within 10% of
  `--time-gpus` (64) and that holds an 8-GPU node is kept (else the closest).
  Each worker keeps its node's GPU count and model, CPU cores = cpu_milli/1000
  and memory GB = memory_mib/1024.
* **Jobs.** `--time-jobs` (1,000) pods drawn with the seed from the `default`
  workload's GPU pods that ran (scheduled, deletion > scheduled), kept in trace
  creation order. CPU-only pods are left out: the policies differ only on GPUs.
  A GPU-sharing pod (gpu_milli < 1000) takes one whole GPU. CPU cores are
  rounded up to whole cores (the spec's `ext_ml_cpu_cores` is an integer).
  Durations are the real `deletion - scheduled`, capped at `--time-cap-hours`
  (24 h; about 3% of pods run longer, some for months, and one such job would
  otherwise set the makespan alone). Pods that fit no drawn worker are dropped
  (reported as `dropped`).
* **Arrivals.** Poisson (seeded exponential gaps) in creation order, scaled so
  that load = sum(GPUs x duration) / (cluster GPUs x arrival span) is exactly
  the target (`--time-loads`, 70/100/130%). The same draw serves every load and
  policy, so runs differ only in spacing and policy.
* **Bands.** QoS Guaranteed and LS -> reserved; Burstable -> on-demand; BE ->
  spot, preemptible, checkpointing every 300 s of run time: a preempted job
  loses `elapsed mod 300` s and later resumes with the rest of its duration.
  Preemption takes no time (victims stop when chosen).
* **Policies.** `pull` (before the fleet scheduler): at every event, workers in
  a fresh random order each take the first job in FIFO order that fits their
  free capacity, round after round until no worker takes one; then each
  reserved job that still fits nowhere preempts spot jobs (newest first) on the
  first worker, in that random order, where that frees enough (the old
  per-worker gate; no minimum run time). `strict`: only the head of fleet order
  (band, priority, submit) may start, on the worker `schedule()` picks; it
  never preempts and nothing behind a blocked head starts. `ojs`:
  `schedule(pending, fleet, now, DEFAULT_POLICY)` at every event (arrival,
  completion, and the earliest start estimate it annotates, which covers
  victims aging past `min_runtime_before_preemption_s`), with time limits equal
  to the remaining duration: estimates are exact, a best case for backfill.
* **Metrics** (per run, then the mean over `--time-seeds` seeds; a `max` is the
  mean of the per-seed maxima). JCT = finish - submit, and its ratio to the
  mean duration (JCT with zero wait). Wait = first start - submit, p50/p99/max
  per band, for jobs of >= 4 GPUs (`big`) and for all. Idle while waiting: the
  integral over time of the free GPUs of every worker on which at least one
  waiting job (GPUs, cores and memory) would fit now, as % of cluster
  GPU-seconds over the makespan (first arrival to last finish); reservations
  that drain a worker for a big job count as idle. Preemptions and the
  GPU-seconds of work they lost. Utilisation = busy GPU-seconds (lost work
  included) / (cluster GPUs x makespan). `idle_in_total_pct` is the looser
  definition of docs' performance notes: all free GPUs, while some waiting job
  asks for no more GPUs than are free in total (on any mix of workers); it
  counts fragmentation, which the per-worker figure cannot see.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any

from bench.replay_sim import Core, Job, Sim, Worker, ojs, pull, strict
from bench.trace import Node, Pod, load_nodes, load_pods
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.scheduler import DEFAULT_POLICY
from celery_ojs_ml.testing.builders import worker_with

POLICIES = ("pull", "strict", "ojs", "fair")
BANDS = {"Guaranteed": "reserved", "LS": "reserved", "Burstable": "on-demand", "BE": "spot"}
GPU_TYPES = {  # trace model -> (catalogue-style type id, VRAM GB, compute capability)
    "T4": ("nvidia-t4", 16.0, "7.5"),
    "P100": ("nvidia-p100", 16.0, "6.0"),
    "V100M16": ("nvidia-v100", 16.0, "7.0"),
    "V100M32": ("nvidia-v100", 32.0, "7.0"),
    "A10": ("nvidia-a10", 24.0, "8.6"),
}
FAIR_WEIGHTS = {"team-a": 2.0, "team-b": 1.0, "team-c": 1.0}
"""Each job is in one of these queues (a seeded uniform draw); `fair` weighs them so."""
BIG = 4
"""Jobs of at least this many GPUs are `big`."""
POINTS = 200
"""Wait distributions are sorted waits downsampled to at most this many points."""


@dataclass(frozen=True)
class Config:
    """One replay's shape (everything but the load, policy and seed)."""

    workers: int = 16
    gpus: int = 64
    jobs: int = 1000
    cap_s: float = 86_400.0


DEFAULT = Config()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the time mode."""
    g = parser.add_argument_group("time mode")
    g.add_argument("--time-workers", type=int, default=DEFAULT.workers)
    g.add_argument("--time-gpus", type=int, default=DEFAULT.gpus, help="target cluster GPUs")
    g.add_argument("--time-jobs", type=int, default=DEFAULT.jobs)
    g.add_argument("--time-seeds", type=int, default=3)
    g.add_argument("--time-loads", type=int, nargs="+", default=[70, 100, 130], metavar="PCT")
    g.add_argument("--time-cap-hours", type=float, default=DEFAULT.cap_s / 3600)
    g.add_argument("--time-policies", nargs="+", choices=POLICIES, default=list(POLICIES))


def caps_of(node: Node, name: str) -> Capabilities:
    """A worker's capabilities from a trace node (G2/G3 are undisclosed 8.0-class GPUs)."""
    gpu_type, vram, cc = GPU_TYPES.get(node.model, (f"alibaba-{node.model.lower()}", 24.0, "8.0"))
    return worker_with(
        gpus=node.gpus,
        gpu_type=gpu_type,
        memory_gb=vram,
        cc=cc,
        cpu_cores=node.cpu_milli // 1000,
        ram_gb=node.memory_mib / 1024,
        worker_id=name,
    )


def cluster(nodes: list[Node], config: Config, rng: random.Random) -> list[Worker]:
    """`config.workers` trace nodes near `config.gpus` GPUs in all, one of them 8-GPU."""
    best: list[Node] = []
    for _ in range(500):
        draw = rng.sample(nodes, config.workers)
        total = sum(n.gpus for n in draw)
        if max(n.gpus for n in draw) < 8:
            continue
        if not best or abs(total - config.gpus) < abs(sum(n.gpus for n in best) - config.gpus):
            best = draw
        if abs(total - config.gpus) <= config.gpus / 10:
            break
    return [
        Worker(
            f"w{i:02d}", n.gpus, n.cpu_milli / 1000, n.memory_mib / 1024, caps_of(n, f"w{i:02d}")
        )
        for i, n in enumerate(best)
    ]


@lru_cache(maxsize=1)
def ran_gpu_pods() -> list[Pod]:
    """The default workload's GPU pods that ran, in creation order."""
    return [
        p
        for p in load_pods("default")
        if p.num_gpu and p.scheduled is not None and (p.deletion or 0) > p.scheduled
    ]


def draw_jobs(
    workers: list[Worker], config: Config, rng: random.Random, seed: int = 0
) -> list[Job]:
    """The seed's jobs that fit some worker, in creation order, all arriving at 0 (`arrive`).

    Queues come from a stream of their own, so the jobs and arrivals do not depend on them.
    """
    pods = ran_gpu_pods()
    teams = random.Random(f"queues-{seed}")
    picked = sorted(rng.sample(range(len(pods)), min(config.jobs, len(pods))))
    jobs = []
    for order, i in enumerate(picked):
        p = pods[i]
        job = Job(
            p.name,
            order,
            0.0,
            p.num_gpu,
            float(max(1, math.ceil(p.cpu_milli / 1000))),
            p.memory_mib / 1024,
            BANDS[p.qos],
            min(float((p.deletion or 0) - (p.scheduled or 0)), config.cap_s),
            teams.choice(sorted(FAIR_WEIGHTS)),
        )
        if any(w.fits(job.kind) for w in workers):
            jobs.append(job)
    return jobs


def arrive(jobs: list[Job], gaps: list[float], gpus: int, load: float) -> list[Job]:
    """Arrival times from unit gaps, scaled so that the jobs' load is exactly `load`."""
    work = sum(j.gpus * j.duration for j in jobs)
    scale = work / (gpus * load) / (sum(gaps[1:]) or 1.0)
    t, out = 0.0, list[Job]()
    for j, gap in zip(jobs, gaps, strict=True):
        t += gap * scale if out else 0.0
        out.append(Job(j.id, j.order, t, j.gpus, j.cpu, j.mem, j.band, j.duration, j.queue))
    return out


def build(config: Config, seed: int, load: float) -> tuple[list[Worker], list[Job], int]:
    """The seed's cluster and jobs at `load` (a fraction), and the pods dropped."""
    rng = random.Random(seed)
    workers = cluster(load_nodes(), config, rng)
    jobs = draw_jobs(workers, config, rng, seed)
    gaps = [rng.expovariate(1.0) for _ in jobs]
    gpus = sum(w.gpus for w in workers)
    return workers, arrive(jobs, gaps, gpus, load), config.jobs - len(jobs)


def replay(config: Config, seed: int, load: float, policy: str) -> Sim:
    """One replay, checked (every job finished exactly once)."""
    workers, jobs, _ = build(config, seed, load)
    sim = Sim(workers, jobs, seed)
    dispatch = dispatcher(policy, Core())
    sim.run(dispatch)
    return sim


def dispatcher(policy: str, core: Core) -> Callable[[Sim], None]:
    """The policy's dispatch function; `fair` is `ojs` with `FAIR_WEIGHTS` as fair-share weights."""
    if policy == "pull":
        return pull
    if policy == "strict":
        return strict(core)
    if policy == "fair":
        return ojs(core, replace(DEFAULT_POLICY, weights=tuple(sorted(FAIR_WEIGHTS.items()))))
    return ojs(core)


def run_one(args: tuple[Config, int, str, int]) -> tuple[int, str, int, dict[str, Any]]:
    """(config, load %, policy, seed) -> the same and the run's metrics."""
    config, load, policy, seed = args
    start = time.perf_counter()
    sim = replay(config, seed, load / 100, policy)
    out = metrics(sim)
    out["seconds"] = time.perf_counter() - start
    return load, policy, seed, out


def quantile(xs: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted `xs`."""
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def waits_of(waits: list[float]) -> dict[str, float | int | None]:
    xs = sorted(waits)
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {"n": len(xs), "p50": quantile(xs, 0.5), "p99": quantile(xs, 0.99), "max": xs[-1]}


def downsample(xs: list[float], points: int = POINTS) -> list[float]:
    """Sorted `xs` at most `points` long, evenly spaced in rank, ends kept."""
    xs = sorted(xs)
    if len(xs) <= points:
        return xs
    return [xs[round(i * (len(xs) - 1) / (points - 1))] for i in range(points)]


def metrics(sim: Sim) -> dict[str, Any]:
    """The run's figures (definitions in the module doc)."""
    jobs = list(sim.jobs.values())
    gpus = sum(w.gpus for w in sim.workers.values())
    t0 = min(j.arrival for j in jobs)
    makespan = max(sim.finish.values()) - t0
    work = sum(j.gpus * j.duration for j in jobs)
    wait = {j.id: sim.first_start[j.id] - j.arrival for j in jobs}
    jct = statistics.fmean(sim.finish[j.id] - j.arrival for j in jobs)
    lb = statistics.fmean(j.duration for j in jobs)
    groups = {band: [wait[j.id] for j in jobs if j.band == band] for band in BANDS.values()}
    groups["big"] = [wait[j.id] for j in jobs if j.gpus >= BIG]
    groups["all"] = list(wait.values())
    return {
        "jobs": len(jobs),
        "gpus": gpus,
        "mean_jct_s": jct,
        "jct_lb_s": lb,
        "jct_ratio": jct / lb,
        "wait_s": {name: waits_of(ws) for name, ws in groups.items()},
        "idle_while_waiting_pct": 100 * sim.idle_wait_gpu_s / (gpus * makespan),
        "idle_in_total_pct": 100 * sim.idle_total_gpu_s / (gpus * makespan),
        "idle_if_packed_pct": 100 * sim.idle_capable_gpu_s / (gpus * makespan),
        "fair_share": fair_share(sim),
        "preemptions": sim.preemptions,
        "lost_gpu_s": sim.lost_gpu_s,
        "lost_pct": 100 * sim.lost_gpu_s / work,
        "makespan_s": makespan,
        "makespan_lb_s": max(work / gpus, max(j.arrival + j.duration for j in jobs) - t0),
        "utilisation_pct": 100 * sim.busy_gpu_s / (gpus * makespan),
        "passes": sim.passes,
        "waits": downsample(groups["all"]),
        "waits_big": downsample(groups["big"]),
    }


def fair_share(sim: Sim) -> dict[str, Any]:
    """Each queue's share of the GPUs held while every queue had a job waiting, and its
    weight's share (`target`); `gap`: the largest difference, percentage points."""
    total = sum(sim.contended_gpu_s.values())
    weight = sum(FAIR_WEIGHTS.get(q, 1.0) for q in sim.queues)
    shares = {q: 100 * g / total if total else None for q, g in sim.contended_gpu_s.items()}
    targets = {q: 100 * FAIR_WEIGHTS.get(q, 1.0) / weight for q in sim.queues}
    gaps = [abs(v - targets[q]) for q, v in shares.items() if v is not None]
    return {
        "contended_pct": 100 * sim.contended_s / max(sim.now, 1e-9),
        "share_pct": shares,
        "target_pct": targets,
        "gap_pp": max(gaps) if gaps else None,
    }


def mean_of(values: list[Any]) -> Any:
    """The mean over seeds, member by member (None where no seed has a value)."""
    first = values[0]
    if isinstance(first, dict):
        return {k: mean_of([v[k] for v in values]) for k in first}
    if isinstance(first, list):
        return downsample([x for v in values for x in v])
    found = [v for v in values if v is not None]
    return statistics.fmean(found) if found else None


def main(opts: argparse.Namespace) -> dict[str, Any]:
    """Run the time mode; the JSON-able result (shape in `describe`)."""
    config = Config(opts.time_workers, opts.time_gpus, opts.time_jobs, opts.time_cap_hours * 3600)
    runs = [
        (config, load, policy, seed)
        for load in opts.time_loads
        for policy in opts.time_policies
        for seed in range(opts.time_seeds)
    ]
    start = time.perf_counter()
    with multiprocessing.Pool(opts.jobs) as pool:
        done = pool.map(run_one, runs, chunksize=1)
    result: dict[str, Any] = {}
    for load in opts.time_loads:
        result[str(load)] = {
            policy: mean_of([m for (ld, p, _, m) in done if (ld, p) == (load, policy)])
            for policy in opts.time_policies
        }
    seconds = time.perf_counter() - start
    result["meta"] = describe(config, opts, seconds)
    if not opts.json:
        print_tables(result, opts.time_loads, opts.time_policies)
        print(f"\n{len(runs)} runs, {seconds:.0f} s in all")
    return result


def describe(config: Config, opts: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """What the result holds, for readers and plots."""
    return {
        "mode": "time",
        "config": {**asdict(config), "seeds": opts.time_seeds, "loads_pct": opts.time_loads},
        "policies": list(opts.time_policies),
        "seconds": seconds,
        "shape": "result[load %][policy] = metrics, mean over seeds; waits: sorted wait "
        "seconds of all seeds' jobs, downsampled to <= 200 points (waits_big: jobs >= 4 GPUs)",
    }


def _s(x: float | None) -> str:
    """Seconds, compactly: 42s, 12m, 3.4h."""
    if x is None:
        return "-"
    if x < 600:
        return f"{x:.0f}s"
    return f"{x / 60:.0f}m" if x < 36_000 else f"{x / 3600:.1f}h"


def print_tables(result: dict[str, Any], loads: list[int], policies: list[str]) -> None:
    head = (
        "policy",
        "JCT",
        "/LB",
        "idle%",
        "packed%",
        "idleTot%",
        "util%",
        "mkspan",
        "/LB",
        "preempt",
        "lostGPUh",
    )
    bands = ("reserved", "on-demand", "spot", "big", "all")
    for load in loads:
        print(f"\nload {load}%  (mean of seeds; waits p50/p99/max)")
        print("".join(f"{h:>9}" for h in head))
        for p in policies:
            m = result[str(load)][p]
            cells = (
                p,
                _s(m["mean_jct_s"]),
                f"{m['jct_ratio']:.2f}",
                f"{m['idle_while_waiting_pct']:.2f}",
                f"{m['idle_if_packed_pct']:.2f}",
                f"{m['idle_in_total_pct']:.2f}",
                f"{m['utilisation_pct']:.1f}",
                _s(m["makespan_s"]),
                f"{m['makespan_s'] / m['makespan_lb_s']:.2f}",
                f"{m['preemptions']:.0f}",
                f"{m['lost_gpu_s'] / 3600:.1f}",
            )
            print("".join(f"{c:>9}" for c in cells))
        print(f"{'wait':>9}" + "".join(f"{b:>20}" for b in bands))
        for p in policies:
            w = result[str(load)][p]["wait_s"]
            spans = ["/".join(_s(w[b][q]) for q in ("p50", "p99", "max")) for b in bands]
            print(f"{p:>9}" + "".join(f"{c:>20}" for c in spans))
        print_shares(result[str(load)], policies)


def print_shares(by_policy: dict[str, Any], policies: list[str]) -> None:
    """Per-queue GPU shares while every queue waited, against the weights' shares."""
    first = by_policy[policies[0]]["fair_share"]["target_pct"]
    target = " ".join(f"{q} {v:.0f}%" for q, v in first.items())
    print(f"{'shares':>9}  while every queue had a job waiting (target: {target})")
    for p in policies:
        f = by_policy[p]["fair_share"]
        shares = " ".join(
            f"{q} {'-' if v is None else f'{v:.0f}%'}" for q, v in f["share_pct"].items()
        )
        gap = "-" if f["gap_pp"] is None else f"{f['gap_pp']:.0f} pp"
        print(f"{p:>9}  {shares}  gap {gap}  (contended {f['contended_pct']:.0f}% of the time)")
