"""Leader pass benchmark: the live leader's scheduling pass, phase by phase, 100 to 10,000 workers.

Each fleet size gets its own private `redis-server` (or `--redis-url`, under a fresh key
prefix). `bench.metrics.populate` writes `--workers` advertised 8-GPU workers, each
running two leased 2-GPU jobs; `--jobs` waiting 2-GPU jobs, made as `populate` makes
them but with the class id the router gives them (the leader refuses `populate`'s
placeholder), are admitted through `PendingBook.admit_many`. A real `FleetScheduler` of a
Celery app with `OJSML(app)` on that Redis (broker and store) takes the lock and runs
`--passes` passes of `schedule_once()`; the first after `hello` is full (it decides every
waiting job), the others quick (the first `ojs_ml_queue_depth` jobs of the window).
Each phase is timed by wrapping the leader's bound methods:

* first_reads  `PassInputs.first_reads`: the pending index and change marks, whether
               reservations exist, heartbeats and leases (through the change feeds);
* fleet        `PassInputs.fleet`: the policy core's view of the workers;
* core         the policy core's `schedule`, as the leader times it (`decided`);
* carry_out    `FleetScheduler._carry_out`: deliveries, notes, prefetch;
* other        the rest of the pass: take-backs, waiting jobs, holds, fair share,
               reservations, grants;
* pass         the whole `schedule_once()`.

Between passes the workers' side (an `OJSStore` of its own, which remembers what each
worker sent) re-advertises `--changed` (1 %) of the workers with another `free` snapshot
and writes their leases again, and refreshes `--refreshed` (10 %) unchanged, their
leases' deadlines too: only the changed values go to the feeds.

Baseline: the reads each pass made before the feeds, `store.live_workers()` and
`LeaseBook.all()` (every heartbeat and every lease read and parsed), timed side by side
with the leader's feed reads (`inputs.feeds`) over `--rounds` rounds of the same churn;
`ratio` is old / feed, of the medians. Both must return the same workers and leases (a
heartbeat's `ts` and a lease's `deadline` within 2 ms: the feed derives them from the
index scores), or the run stops with the difference. `rss_mb` is the process's resident
set after the size's passes (the sizes share one process, smallest first).

The cyclic GC stays on, as in a leader process: only the core runs with it paused
(`leader/gc_pause.py`), so a collection may land in any other phase. The assignment
timeout and the full-pass interval are set to an hour: no worker starts the assigned
jobs, which would otherwise be taken back, and no quick pass turns full.

    .venv/bin/python bench/leader_pass.py [--workers 100 1000 10000] [--jobs 100000]
        [--passes 11] [--rounds 10] [--json] [--out bench/results/leader_pass]
        [--redis-url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from celery import Celery

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.metrics import _pending, populate, private_redis  # noqa: E402
from celery_ojs_ml import OJSML  # noqa: E402
from celery_ojs_ml.leader.loop import FleetScheduler  # noqa: E402
from celery_ojs_ml.spec.classes import class_id  # noqa: E402
from celery_ojs_ml.spec.normalize import normalize  # noqa: E402
from celery_ojs_ml.store.leases import LeaseBook  # noqa: E402
from celery_ojs_ml.store.pending import PendingBook  # noqa: E402
from celery_ojs_ml.store.registry import OJSStore  # noqa: E402
from celery_ojs_ml.wire import headers as h  # noqa: E402

PHASES = ("first_reads", "fleet", "core", "carry_out", "other", "pass")
HOUR_S = 3600.0
"""Heartbeats and leases outlive the run, as `populate` writes them."""
STAMP_TOLERANCE_S = 0.002
"""A feed read's heartbeat `ts` and lease `deadline` come from index scores in ms."""
ADMIT_BATCH = 5000
JOB_CLASS = class_id(
    normalize({"ext_ml_gpu_count": 2, "ext_ml_gpu_type": "nvidia-a100"}).requirements
)
"""The class the router gives `populate`'s jobs, whose placeholder class the leader refuses."""


def admit(store: OJSStore, jobs: int) -> None:
    """`jobs` waiting 2-GPU jobs as `populate` makes them, with the class their headers ask."""
    book = PendingBook(store)
    for start in range(0, jobs, ADMIT_BATCH):
        batch = [_pending(i) for i in range(start, min(jobs, start + ADMIT_BATCH))]
        for _, _, msg in batch:
            msg["headers"][h.CLASS] = JOB_CLASS
        book.admit_many(batch)


@dataclass
class Workers:
    """The workers' side of the fleet: their own store and what each advertises."""

    store: OJSStore
    beats: dict[str, dict[str, Any]]
    leases: dict[str, list[dict[str, Any]]]
    shares: tuple[float, float]
    """(changed, refreshed) share of the workers per tick."""
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    busier: set[str] = field(default_factory=set)
    """Workers now advertising `_busier` snapshots."""

    @classmethod
    def of(cls, store: OJSStore, changed: float, refreshed: float) -> Workers:
        """The fleet `populate` wrote, read back as each worker last sent it."""
        beats = {
            name: {k: entry[k] for k in ("capabilities", "free", "info")}
            for name, entry in store.live_workers().items()
        }
        leases: dict[str, list[dict[str, Any]]] = {}
        for lease in LeaseBook(store, HOUR_S).all():
            leases.setdefault(str(lease["worker"]), []).append(lease)
        return cls(store, beats, leases, (changed, refreshed))

    def tick(self) -> None:
        """Heartbeats and lease refreshes between two passes (see module doc)."""
        names = list(self.beats)
        changes = max(1, round(self.shares[0] * len(names)))
        refreshes = round(self.shares[1] * len(names))
        picked = self.rng.sample(names, min(len(names), changes + refreshes))
        changed, refreshed = picked[:changes], picked[changes:]
        self.busier.symmetric_difference_update(changed)
        with self.store.client.pipeline(transaction=False) as pipe:
            for name in picked:
                beat = self.beats[name]
                free = _busier(beat["free"], name) if name in self.busier else beat["free"]
                for command in self.store.advertise_commands(
                    name, beat["capabilities"], free, ttl_s=HOUR_S, info=beat["info"]
                ):
                    pipe.execute_command(*command)  # type: ignore[no-untyped-call]
            pipe.execute()
        book = LeaseBook(self.store, HOUR_S)
        book.refresh({x["task_id"]: x["token"] for n in refreshed for x in self.leases[n]})
        again = [book.new_lease(x, x["token"])[1] for n in changed for x in self.leases[n]]
        book.write_batch(again, [])


def _busier(free: dict[str, Any], name: str) -> dict[str, Any]:
    """`free` with one more 2-GPU job, on devices 4 and 5: a change the feed must carry."""
    task_id = f"{name}/extra"
    extra = {**free["allocations"][0], "task_id": task_id, "devices": [4, 5]}
    counts = {**free["free"], "gpu_count": free["free"]["gpu_count"] - 2}
    devices = {**free["devices"], "4": task_id, "5": task_id}
    allocations = [*free["allocations"], extra]
    return {**free, "allocations": allocations, "free": counts, "devices": devices}


class Phases:
    """Seconds per phase of the pass under way, filled by wrapped bound methods."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.now[phase] = self.now.get(phase, 0.0) + seconds

    def wrap(self, owner: object, method: str, phase: str) -> None:
        """Time every call of `owner.method` into `phase`."""
        inner: Callable[..., Any] = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - began)

        setattr(owner, method, timed)

    def instrument(self, leader: FleetScheduler) -> None:
        """Wrap the leader's phases; the core's time is the one the leader measures."""
        self.wrap(leader.inputs, "first_reads", "first_reads")
        self.wrap(leader.inputs, "fleet", "fleet")
        self.wrap(leader, "_carry_out", "carry_out")
        decided = leader.inputs.decided

        def core(cost_s: float) -> None:
            self.add("core", cost_s)
            decided(cost_s)

        setattr(leader.inputs, "decided", core)  # noqa: B010


@contextmanager
def leading(url: str, prefix: str) -> Iterator[FleetScheduler]:
    """A leader of a real Celery app on `url` (broker and store), holding the lock."""
    app = Celery("leader-pass", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        ojs_ml_store_prefix=prefix, ojs_ml_leader_ttl_s=300.0,
        ojs_ml_assignment_timeout_s=HOUR_S, ojs_ml_full_pass_s=HOUR_S,
    )  # fmt: skip
    OJSML(app)
    leader = FleetScheduler(app, candidate="bench-leader")
    if not leader.book.lead(leader.candidate, leader.settings.leader_ttl_s):
        raise RuntimeError("the bench's leader did not get the scheduler lock")
    leader.inputs.hello()
    leader.intake.connect()
    try:
        yield leader
    finally:
        leader.close()
        leader.book.resign(leader.candidate)
        app.close()


def run_passes(
    leader: FleetScheduler, workers: Workers, passes: int
) -> tuple[dict[str, list[dict[str, float]]], int]:
    """Each pass's phase times by kind ("full", "quick"), and the first pass's assignments."""
    phases = Phases()
    phases.instrument(leader)
    kinds: dict[str, list[dict[str, float]]] = {"full": [], "quick": []}
    assigned = 0
    for i in range(passes):
        if i:
            workers.tick()
        phases.now = {}
        began = time.perf_counter()
        decision = leader.schedule_once()
        total = time.perf_counter() - began
        leader.link.settle()
        if i == 0:
            assigned = len(decision.assignments)
        row = {p: phases.now.get(p, 0.0) for p in PHASES[:4]}
        row["other"] = total - sum(row.values())
        row["pass"] = total
        kinds["full" if leader.inputs.deciding_all else "quick"].append(row)
    return kinds, assigned


def same(full: dict[str, Any], fed: dict[str, Any], stamp: str, what: str) -> None:
    """Stop the run unless the feed read equals the full read (`stamp` within tolerance)."""
    if set(full) != set(fed):
        missing, extra = sorted(set(full) - set(fed))[:5], sorted(set(fed) - set(full))[:5]
        raise RuntimeError(f"feed read of {what}: missing {missing}, extra {extra}")
    for name, record in full.items():
        other = fed[name]
        drift = abs(float(record.get(stamp) or 0.0) - float(other.get(stamp) or 0.0))
        rest = {k: v for k, v in record.items() if k != stamp}
        if drift > STAMP_TOLERANCE_S or rest != {k: v for k, v in other.items() if k != stamp}:
            raise RuntimeError(f"feed read of {what} {name} differs:\n{record}\n{other}")


def compare_reads(leader: FleetScheduler, workers: Workers, rounds: int) -> dict[str, Any]:
    """The old reads against the leader's feed reads, after the same churn each round."""
    store, feeds = leader.store, leader.inputs.feeds
    book = LeaseBook(store, leader.settings.lease_ttl_s)
    old: list[float] = []
    new: list[float] = []
    reread: list[tuple[int, int]] = []
    if rounds < 1:
        raise ValueError("--rounds must be at least 1")
    for _ in range(rounds):
        workers.tick()
        began = time.perf_counter()
        live, leases = store.live_workers(), book.all()
        middle = time.perf_counter()
        fed_live = feeds.workers.read(store.live_read("worker")[2])
        fed_leases = feeds.leases.read()
        old.append(middle - began)
        new.append(time.perf_counter() - middle)
        same(live, fed_live, "ts", "heartbeats")
        same({x["task_id"]: x for x in leases}, fed_leases, "deadline", "leases")
        reread.append((feeds.workers.read_values, feeds.leases.read_values))
    return {
        "old_ms": spread(old),
        "feed_ms": spread(new),
        "ratio": round(statistics.median(old) / max(statistics.median(new), 1e-9), 1),
        "reread_workers": statistics.median(w for w, _ in reread),
        "reread_leases": statistics.median(x for _, x in reread),
        "workers": len(live),
        "leases": len(leases),
        "equal": True,
    }


def spread(seconds: list[float]) -> dict[str, float]:
    """Median and max of `seconds`, in ms."""
    ms = [s * 1000 for s in seconds]
    return {"median": round(statistics.median(ms), 2), "max": round(max(ms), 2)}


def run_size(url: str, workers: int, jobs: int, args: argparse.Namespace) -> dict[str, Any]:
    """One fleet size on the Redis at `url`, under a fresh key prefix (removed after)."""
    prefix = f"lp-{uuid.uuid4().hex[:6]}"
    side = OJSStore.from_url(url, prefix=prefix)
    try:
        began = time.perf_counter()
        populate(side, workers, 0)
        admit(side, jobs)
        PendingBook(side).resign("leader@fleet")  # `populate`'s stand-in leader
        populated_s = time.perf_counter() - began
        fleet = Workers.of(side, args.changed, args.refreshed)
        with leading(url, prefix) as leader:
            kinds, assigned = run_passes(leader, fleet, args.passes)
            rss_mb = psutil.Process(os.getpid()).memory_info().rss / 2**20
            reads = compare_reads(leader, fleet, args.rounds)
    finally:
        keys = list(side.client.scan_iter(match=f"{prefix}*", count=10_000))
        for start in range(0, len(keys), 10_000):  # a shared `--redis-url` outlives the run
            side.client.unlink(*keys[start : start + 10_000])
        side.close()
    passes = {
        kind: {"count": len(rows), **{p: spread([r[p] for r in rows]) for p in PHASES}}
        for kind, rows in kinds.items()
        if rows
    }
    return {
        "workers": workers, "jobs": jobs, "populate_s": round(populated_s, 2),
        "first_pass_assigned": assigned, "passes": passes, "reads": reads,
        "rss_mb": round(rss_mb, 1),
    }  # fmt: skip


def table(found: dict[str, Any]) -> list[str]:
    """The results as markdown tables (ms: median / max)."""
    lines = [
        f"leader pass: {found['jobs']} waiting jobs, 2 leased jobs per worker, "
        f"{found['changed']:.0%} of workers changed and {found['refreshed']:.0%} "
        f"refreshed between passes; ms, median / max; run {found['run_s']:.0f} s",
        "",
        "| workers | pass | n | " + " | ".join(PHASES) + " |",
        "|---:|---|---:|" + "---:|" * len(PHASES),
    ]
    for size in found["sizes"]:
        for kind, row in size["passes"].items():
            cells = " | ".join(f"{row[p]['median']:.1f} / {row[p]['max']:.1f}" for p in PHASES)
            lines.append(f"| {size['workers']} | {kind} | {row['count']} | {cells} |")
    lines += [
        "",
        "| workers | leases | old reads | feed reads | old/feed | re-read workers / leases "
        "| populate s | first pass assigned | RSS MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in found["sizes"]:
        r = size["reads"]
        lines.append(
            f"| {size['workers']} | {r['leases']} "
            f"| {r['old_ms']['median']:.1f} / {r['old_ms']['max']:.1f} "
            f"| {r['feed_ms']['median']:.1f} / {r['feed_ms']['max']:.1f} | {r['ratio']:.1f} "
            f"| {r['reread_workers']:g} / {r['reread_leases']:g} | {size['populate_s']:.1f} "
            f"| {size['first_pass_assigned']} | {size['rss_mb']:.0f} |"
        )
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see module doc)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, nargs="+", default=[100, 1000, 10_000])
    parser.add_argument("--jobs", type=int, default=100_000, help="waiting jobs (100000)")
    parser.add_argument("--passes", type=int, default=11, help="passes per size (11)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of old/feed reads (10)")
    parser.add_argument("--changed", type=float, default=0.01, help="share changed per tick")
    parser.add_argument("--refreshed", type=float, default=0.1, help="share refreshed per tick")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--out", metavar="DIR", help="write leader_pass.json and .md there")
    parser.add_argument("--redis-url", help="use this Redis instead of private redis-servers")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every size; print (and with `--out` write) the results, and return them."""
    args = parse(argv)
    sizes = []
    began = time.perf_counter()
    for n in args.workers:
        if args.redis_url:
            sizes.append(run_size(args.redis_url, n, args.jobs, args))
            continue
        with private_redis() as url:
            sizes.append(run_size(url, n, args.jobs, args))
    found = {
        "jobs": args.jobs, "passes": args.passes, "rounds": args.rounds,
        "changed": args.changed, "refreshed": args.refreshed,
        "run_s": round(time.perf_counter() - began, 1), "sizes": sizes,
    }  # fmt: skip
    lines = table(found)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "leader_pass.json").write_text(json.dumps(found, indent=1) + "\n")
        (out / "leader_pass.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(found, indent=2) if args.json else "\n".join(lines))
    return found


if __name__ == "__main__":
    main()
