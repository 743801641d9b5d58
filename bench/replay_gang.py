"""Gangs among a stream of small jobs: the fleet scheduler against pull-based placement.

    .venv/bin/python bench/replay_gang.py [--workers 16] [--small 2000] [--load 0.9]
        [--gangs 8x8 2x4 4x8 4x4 2x8] [--seed 0] [--json] [--plot FILE.png]

A synthetic workload on `--workers` workers of 8 A100 GPUs (64 cores, 512 GB):

* **Small jobs.** `--small` 1-GPU jobs (4 cores, 32 GB), run times log-uniform
  5 min to 2 h, Poisson arrivals (seeded) over the arrival span.
* **Gangs.** One per `--gangs` entry `RANKSxGPUS`: RANKS ranks of GPUS GPUs
  each (4 cores and 32 GB per GPU), all ranks submitted together, one run time
  for all (uniform 1-2 h), arriving in the order given at evenly spaced times
  over 10-60 % of the arrival span.
* **Load.** The arrival span is set so that all the work (small jobs and gangs)
  is `--load` of the fleet's GPU-seconds over the span. All jobs are on-demand,
  so neither policy preempts.

Policies, both driven by `bench/replay_sim.py`'s event engine:

* `ojs`: `schedule(pending, fleet, now, DEFAULT_POLICY)` at every event (the
  live leader's pure core, `replay_sim.ojs`), each rank a `PendingJob` with
  `gang`, `gang_size` and `rank` set as the leader reads them from the spec, so
  gangs go through `scheduler.gang` and `core.Planner.decide_gang`: all ranks
  at once on distinct workers, else a reservation (Flux RFC 27 backfill) that
  later jobs may only backfill around. Time limits equal the remaining run
  time (exact estimates, a best case for backfill).
* `pull`: `replay_sim.pull`'s behaviour with gangs taken whole: at every event,
  workers in a fresh random order each take the first job in FIFO order that
  fits their free capacity now, round after round; a gang fits when the worker
  holds one rank and distinct other workers hold the rest now (first in that
  random order), and then all its ranks start. Nothing is reserved.

Reported per policy: each gang's wait (first start - submit), the largest
gang's (most GPUs), the mean and max over gangs, the small jobs' mean and p99
wait, utilisation (busy GPU-seconds / fleet GPU-seconds over the makespan) and
the makespan. `--plot` draws the gang waits, the small jobs' wait CDF and the
busy GPUs over time (gang starts marked).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.replay_sim import Core, Job, Observer, Sim, Worker, ojs
from celery_ojs_ml.capabilities import resolve_capabilities
from celery_ojs_ml.scheduler import PendingJob

POLICIES = ("ojs", "pull")
GPUS_PER_WORKER = 8
CPU_PER_GPU = 4.0
MEM_PER_GPU = 32.0


@dataclass(frozen=True, slots=True)
class Gang:
    """A gang of the workload: `ranks` jobs of `gpus` GPUs each, ids `{gid}-r{rank}`."""

    gid: str
    ranks: int
    gpus: int

    @property
    def total(self) -> int:
        return self.ranks * self.gpus

    def rank_ids(self) -> list[str]:
        return [f"{self.gid}-r{r}" for r in range(self.ranks)]


@dataclass(frozen=True)
class Workload:
    """The fleet, every job (gang ranks included) and the gangs."""

    workers: list[Worker]
    jobs: list[Job]
    gangs: list[Gang]

    def of(self) -> dict[str, tuple[Gang, int]]:
        """Each rank's gang and rank number."""
        return {rid: (g, r) for g in self.gangs for r, rid in enumerate(g.rank_ids())}


def parse_gangs(specs: Iterable[str]) -> list[Gang]:
    """`RANKSxGPUS` entries to gangs `g0`, `g1`, ... in the order given."""
    out = []
    for i, spec in enumerate(specs):
        ranks, gpus = (int(x) for x in spec.lower().split("x"))
        if not 1 <= gpus <= GPUS_PER_WORKER or ranks < 1:
            raise SystemExit(f"gang {spec!r}: RANKSxGPUS with 1-{GPUS_PER_WORKER} GPUs a rank")
        out.append(Gang(f"g{i}-{ranks}x{gpus}", ranks, gpus))
    return out


def fleet(workers: int) -> list[Worker]:
    """`workers` workers of 8 x A100 (64 cores, 512 GB)."""
    caps = resolve_capabilities("profile:nvidia-a100x8")
    cpu, mem = CPU_PER_GPU * GPUS_PER_WORKER, MEM_PER_GPU * GPUS_PER_WORKER * 2
    return [
        Worker(
            f"w{i:02d}",
            GPUS_PER_WORKER,
            cpu,
            mem,
            caps.model_copy(update={"worker_id": f"w{i:02d}"}),
        )
        for i in range(workers)
    ]


def job(jid: str, order: int, at: float, gpus: int, duration: float) -> Job:
    return Job(jid, order, at, gpus, CPU_PER_GPU * gpus, MEM_PER_GPU * gpus, "on-demand", duration)


def build(workers: int, small: int, gang_specs: Iterable[str], load: float, seed: int) -> Workload:
    """The seeded workload (module doc); jobs in submit order."""
    rng = random.Random(seed)
    gangs = parse_gangs(gang_specs)
    if any(g.ranks > workers for g in gangs):
        raise SystemExit("a gang has more ranks than there are workers")
    smalls = [math.exp(rng.uniform(math.log(300), math.log(7200))) for _ in range(small)]
    lengths = [rng.uniform(3600, 7200) for _ in gangs]
    work = sum(smalls) + sum(g.total * d for g, d in zip(gangs, lengths, strict=True))
    span = work / (workers * GPUS_PER_WORKER * load)
    gaps = [rng.expovariate(1.0) for _ in smalls]
    scale = span / (sum(gaps) or 1.0)
    timed: list[tuple[float, str, int, float]] = []
    t = 0.0
    for i, (gap, d) in enumerate(zip(gaps, smalls, strict=True)):
        timed.append((t, f"s{i:05d}", 1, d))
        t += gap * scale
    for k, (g, d) in enumerate(zip(gangs, lengths, strict=True)):
        at = span * (0.1 + 0.5 * k / max(1, len(gangs) - 1))
        timed += [(at, rid, g.gpus, d) for rid in g.rank_ids()]
    timed.sort(key=lambda x: (x[0], x[1]))
    jobs = [job(jid, n, at, gpus, d) for n, (at, jid, gpus, d) in enumerate(timed)]
    return Workload(fleet(workers), jobs, gangs)


class GangCore(Core):
    """`Core` whose pending jobs carry their gang, size and rank (as the leader reads them)."""

    def __init__(self, ranks: dict[str, tuple[Gang, int]]) -> None:
        super().__init__()
        self.ranks = ranks
        self._ranked: dict[tuple[str, float], PendingJob] = {}

    def pending(self, sim: Sim, jobs: Iterable[Job]) -> list[PendingJob]:
        out = []
        for p in super().pending(sim, jobs):
            at = self.ranks.get(p.task_id)
            if at is None:
                out.append(p)
                continue
            key = (p.task_id, p.time_limit_s or 0.0)
            if key not in self._ranked:
                g, r = at
                self._ranked[key] = replace(p, gang=g.gid, gang_size=g.ranks, rank=r)
            out.append(self._ranked[key])
        return out


def pull_gangs(workload: Workload) -> Callable[[Sim], None]:
    """`replay_sim.pull` with a gang taken whole, by the worker that reaches it (module doc)."""
    ranks = workload.of()

    def place(sim: Sim, first: str, lead: Job, names: list[str]) -> list[str] | None:
        gang = ranks[lead.id][0]
        others = [n for n in names if n != first and sim.workers[n].fits(lead.kind)]
        if len(others) < gang.ranks - 1:
            return None
        return [first, *others[: gang.ranks - 1]]

    def dispatch(sim: Sim) -> None:
        names = list(sim.workers)
        sim.rng.shuffle(names)
        fifo = [j for j in sorted(sim.waiting.values(), key=lambda j: j.order)
                if j.id not in ranks or ranks[j.id][1] == 0]  # fmt: skip
        taken = True
        while taken and fifo:
            taken = False
            for name in names:
                w = sim.workers[name]
                for j in fifo if w.free_gpus else ():
                    if not w.fits(j.kind):
                        continue
                    where = [name] if j.id not in ranks else place(sim, name, j, names)
                    if where is None:
                        continue
                    ids = [j.id] if j.id not in ranks else ranks[j.id][0].rank_ids()
                    for jid, worker in zip(ids, where, strict=True):
                        sim.start(jid, worker)
                    fifo.remove(j)
                    taken = True
                    break

    return dispatch


def replay(
    workload: Workload, policy: str, seed: int, observe: Observer | None = None
) -> tuple[Sim, list[tuple[float, int]]]:
    """One checked replay (every job finished once) and the busy GPUs after each pass
    (when they changed); `observe` also sees each pass (tests)."""
    sim = Sim([replace_worker(w) for w in workload.workers], workload.jobs, seed)
    dispatch = ojs(GangCore(workload.of())) if policy == "ojs" else pull_gangs(workload)
    busy: list[tuple[float, int]] = []

    def record(s: Sim, started: list[str]) -> None:
        held = sum(w.gpus - w.free_gpus for w in s.workers.values())
        if not busy or busy[-1][1] != held:
            busy.append((s.now, held))
        if observe is not None:
            observe(s, started)

    sim.run(dispatch, record)
    return sim, busy


def replace_worker(w: Worker) -> Worker:
    """A fresh copy of a worker (a `Sim` changes its workers)."""
    return Worker(w.name, w.gpus, w.cpu, w.mem, w.caps)


def metrics(sim: Sim, busy: list[tuple[float, int]], workload: Workload) -> dict[str, Any]:
    """The run's figures (module doc); waits in seconds."""
    wait = {j.id: sim.first_start[j.id] - j.arrival for j in workload.jobs}
    gangs = {g.gid: wait[g.rank_ids()[0]] for g in workload.gangs}
    for g in workload.gangs:
        starts = {sim.first_start[r] for r in g.rank_ids()}
        assert len(starts) == 1, f"{g.gid}: ranks started at {sorted(starts)}"
    ranked = set(workload.of())
    small = sorted(w for jid, w in wait.items() if jid not in ranked)
    largest = max(workload.gangs, key=lambda g: (g.total, g.ranks)) if workload.gangs else None
    gpus = sum(w.gpus for w in sim.workers.values())
    t0 = min(j.arrival for j in workload.jobs)
    makespan = max(sim.finish.values()) - t0
    return {
        "largest_gang": None if largest is None else largest.gid,
        "largest_gang_wait_s": None if largest is None else gangs[largest.gid],
        "gang_wait_s": gangs,
        "gang_mean_wait_s": statistics.fmean(gangs.values()) if gangs else None,
        "gang_max_wait_s": max(gangs.values()) if gangs else None,
        "small_jobs": len(small),
        "small_mean_wait_s": statistics.fmean(small) if small else None,
        "small_p99_wait_s": small[max(0, math.ceil(0.99 * len(small)) - 1)] if small else None,
        "utilisation_pct": 100 * sim.busy_gpu_s / (gpus * makespan),
        "makespan_s": makespan,
        "passes": sim.passes,
        "gang_start_s": {g.gid: sim.first_start[g.rank_ids()[0]] for g in workload.gangs},
        "small_waits": [round(w, 1) for w in downsample(small)],
        "busy": [(round(t, 1), n) for t, n in busy],
    }


def downsample(xs: list[float], points: int = 200) -> list[float]:
    """Sorted `xs`, at most `points` of them evenly spaced in rank, ends kept."""
    if len(xs) <= points:
        return xs
    return [xs[round(i * (len(xs) - 1) / (points - 1))] for i in range(points)]


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """Every policy over the same seeded workload."""
    workload = build(opts.workers, opts.small, opts.gangs, opts.load, opts.seed)
    result: dict[str, Any] = {
        "meta": {
            "workers": opts.workers,
            "gpus": opts.workers * GPUS_PER_WORKER,
            "small": opts.small,
            "gangs": {g.gid: {"ranks": g.ranks, "gpus": g.gpus} for g in workload.gangs},
            "load": opts.load,
            "seed": opts.seed,
        }
    }
    arrivals = {j.id: j.arrival for j in workload.jobs}
    result["meta"]["gang_arrival_s"] = {g.gid: arrivals[g.rank_ids()[0]] for g in workload.gangs}
    for policy in opts.policies:
        sim, busy = replay(workload, policy, opts.seed)
        result[policy] = metrics(sim, busy, workload)
    return result


def _h(x: float | None) -> str:
    """Seconds below 10 min, minutes below 2 h, else hours."""
    if x is None:
        return "-"
    if x < 600:
        return f"{x:.0f} s"
    return f"{x / 60:.0f} min" if x < 7200 else f"{x / 3600:.1f} h"


def print_table(result: dict[str, Any]) -> None:
    meta = result["meta"]
    policies = [p for p in result if p != "meta"]
    print(f"{meta['workers']} workers x 8 GPUs, {meta['small']} 1-GPU jobs, gangs "
          f"{', '.join(meta['gangs'])}, load {meta['load']:.0%}, seed {meta['seed']}")  # fmt: skip
    rows = [
        ("largest gang wait", "largest_gang_wait_s"),
        ("gangs, mean wait", "gang_mean_wait_s"),
        ("gangs, max wait", "gang_max_wait_s"),
        ("small jobs, mean wait", "small_mean_wait_s"),
        ("small jobs, p99 wait", "small_p99_wait_s"),
        ("makespan", "makespan_s"),
    ]
    print(f"{'':24}" + "".join(f"{p:>12}" for p in policies))
    for label, key in rows:
        print(f"{label:24}" + "".join(f"{_h(result[p][key]):>12}" for p in policies))
    print(
        f"{'utilisation':24}" + "".join(f"{result[p]['utilisation_pct']:>11.1f}%" for p in policies)
    )
    for gid in meta["gangs"]:
        print(f"{'  wait, ' + gid:24}" + "".join(
            f"{_h(result[p]['gang_wait_s'][gid]):>12}" for p in policies))  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--small", type=int, default=2000, help="1-GPU jobs")
    parser.add_argument("--gangs", nargs="+", default=["8x8", "2x4", "4x8", "4x4", "2x8"],
                        metavar="RANKSxGPUS")  # fmt: skip
    parser.add_argument("--load", type=float, default=0.9, help="offered load, fraction")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", metavar="FILE.png")
    opts = parser.parse_args(argv)
    result = run(opts)
    if opts.plot:
        from bench.replay_plot import gang_plot

        gang_plot(result, opts.plot)
    if opts.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return result


if __name__ == "__main__":
    main()
