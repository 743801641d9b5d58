"""Leader pass benchmark: the live leader's scheduling pass, phase by phase, 100 to 10,000 workers.

Each fleet size gets its own private `redis-server` (or `--redis-url`, under a fresh key
prefix). `bench.metrics.populate` writes `--workers` advertised 8-GPU workers, each
running two leased 2-GPU jobs; `--jobs` waiting 2-GPU jobs, made as `populate` makes
them but with the class id the router gives them (the leader refuses `populate`'s
placeholder), are admitted through `PendingBook.admit_many` (`leader_pass_fleet`). A real
`FleetScheduler` of a Celery app with `OJSML(app)` on that Redis (broker and store) takes
the lock and runs `--passes` passes of `schedule_once()`; the first after `hello` is full
(it decides every waiting job and fills every worker, two jobs each), the others quick
(the first `ojs_ml_queue_depth` jobs of the window). Two scenarios, named in the results'
heading (and `scenario` in the JSON):

* steady     (`--start`, the default) after each pass the workers' side starts what it
             assigned, as a live fleet's gates do within milliseconds of the delivery
             (`leader_pass_fleet.Workers.start`: record started, lease written, GPUs
             advertised allocated). The later passes see a full fleet, the jobs not
             started waiting, and no assignment in flight: what a live leader sees.
* unstarted  (`--no-start`) no assignment ever starts: every later pass carries the
             first pass's (20,000 at 10,000 workers) in the leader's ledger, its pending
             records and its in-flight accounting. A pessimistic case, not a steady state.

Each phase is timed by wrapping the leader's bound methods:

* first_reads  `PassInputs.first_reads`: the pending index and change marks, whether
               reservations exist, heartbeats and leases (through the change feeds);
* fleet        `PassInputs.fleet`: the policy core's view of the workers;
* core         the policy core's `schedule`, as the leader times it (`decided`);
* carry_out    `FleetScheduler._carry_out`: deliveries, notes, prefetch;
* other        the rest of the pass: take-backs, waiting jobs, holds, fair share,
               reservations, grants;
* pass         the whole `schedule_once()`; the starts come after it, untimed.

Between passes the workers' side (an `OJSStore` of its own, which remembers what each
worker sent) re-advertises `--changed` (1 %) of the workers with another snapshot (one
job more; on a full worker, its newest job swapped for another) and writes their leases
again, and refreshes `--refreshed` (10 %) unchanged, their leases' deadlines too: only
the changed values go to the feeds.

Baseline: the reads each pass made before the feeds, `store.live_workers()` and
`LeaseBook.all()` (every heartbeat and every lease read and parsed), timed side by side
with the leader's feed reads (`inputs.feeds`) over `--rounds` rounds of the same churn;
`ratio` is old / feed, of the medians. Both must return the same workers and leases (a
heartbeat's `ts` and a lease's `deadline` within 2 ms: the feed derives them from the
index scores), or the run stops with the difference. `rss_mb` is the process's resident
set after the size's passes (the sizes share one process, smallest first); `ledger` the
leader's in-flight assignments after them.

The cyclic GC stays on, as in a leader process: only the core runs with it paused
(`leader/gc_pause.py`), so a collection may land in any other phase. The assignment
timeout and the full-pass interval are set to an hour: an unstarted assignment is not
taken back, and no quick pass turns full.

    .venv/bin/python bench/leader_pass.py [--workers 100 1000 10000] [--jobs 100000]
        [--passes 11] [--rounds 10] [--start | --no-start] [--json]
        [--out bench/results/leader_pass] [--redis-url URL]

`--out` writes `leader_pass.json` and `.md` (steady) or `leader_pass_unstarted.json`
and `.md` (unstarted).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from celery import Celery

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.leader_pass_fleet import HOUR_S, Workers, fleet  # noqa: E402
from bench.metrics import private_redis  # noqa: E402
from celery_ojs_ml import OJSML  # noqa: E402
from celery_ojs_ml.leader.loop import FleetScheduler  # noqa: E402
from celery_ojs_ml.store.leases import LeaseBook  # noqa: E402

PHASES = ("first_reads", "fleet", "core", "carry_out", "other", "pass")
STAMP_TOLERANCE_S = 0.002
"""A feed read's heartbeat `ts` and lease `deadline` come from index scores in ms."""
SCENARIOS = {
    True: ("steady", "leader_pass", "each pass's assignments started before the next"),
    False: ("unstarted", "leader_pass_unstarted", "no assignment ever started"),
}
"""`--start` -> (scenario, results file stem, what it means)."""


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


@dataclass
class Passes:
    """What `run_passes` saw: phase times by kind ("full", "quick"), jobs assigned by each
    pass, and how many the workers started, in how many seconds."""

    kinds: dict[str, list[dict[str, float]]] = field(
        default_factory=lambda: {"full": [], "quick": []}
    )
    assigned: list[int] = field(default_factory=list)
    started: int = 0
    start_s: float = 0.0


def run_passes(leader: FleetScheduler, workers: Workers, passes: int, start: bool) -> Passes:
    """`passes` timed passes with the churn between them; with `start`, the workers start
    each pass's assignments after it."""
    phases = Phases()
    phases.instrument(leader)
    seen = Passes()
    for i in range(passes):
        if i:
            workers.tick()
        phases.now = {}
        began = time.perf_counter()
        decision = leader.schedule_once()
        total = time.perf_counter() - began
        leader.link.settle()
        seen.assigned.append(len(decision.assignments))
        if start:
            began = time.perf_counter()
            seen.started += workers.start(decision.assignments)
            seen.start_s += time.perf_counter() - began
        row = {p: phases.now.get(p, 0.0) for p in PHASES[:4]}
        row["other"] = total - sum(row.values())
        row["pass"] = total
        seen.kinds["full" if leader.inputs.deciding_all else "quick"].append(row)
    return seen


def same(
    full: dict[str, Any], fed: dict[str, Any], stamp: str, what: str, tolerance: float
) -> None:
    """Stop the run unless the feed read equals the full read (`stamp` within tolerance)."""
    if set(full) != set(fed):
        missing, extra = sorted(set(full) - set(fed))[:5], sorted(set(fed) - set(full))[:5]
        raise RuntimeError(f"feed read of {what}: missing {missing}, extra {extra}")
    for name, record in full.items():
        other = fed[name]
        drift = abs(float(record.get(stamp) or 0.0) - float(other.get(stamp) or 0.0))
        rest = {k: v for k, v in record.items() if k != stamp}
        if drift > tolerance or rest != {k: v for k, v in other.items() if k != stamp}:
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
        same(live, fed_live, "ts", "heartbeats", STAMP_TOLERANCE_S)
        # Between full reads the leader reads only changed leases: a refresh moves no
        # deadline it holds (it uses none).
        same({x["task_id"]: x for x in leases}, fed_leases, "deadline", "leases", math.inf)
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
    began = time.perf_counter()
    with fleet(url, workers, jobs, args.changed, args.refreshed) as side:
        populated_s = time.perf_counter() - began
        with leading(url, side.prefix) as leader:
            seen = run_passes(leader, side, args.passes, args.start)
            rss_mb = psutil.Process(os.getpid()).memory_info().rss / 2**20
            ledger = len(leader.ledger.entries)
            reads = compare_reads(leader, side, args.rounds)
    passes = {
        kind: {"count": len(rows), **{p: spread([r[p] for r in rows]) for p in PHASES}}
        for kind, rows in seen.kinds.items()
        if rows
    }
    return {
        "workers": workers, "jobs": jobs, "populate_s": round(populated_s, 2),
        "first_pass_assigned": seen.assigned[0], "later_assigned": sum(seen.assigned[1:]),
        "started": seen.started, "start_s": round(seen.start_s, 2), "ledger": ledger,
        "passes": passes, "reads": reads, "rss_mb": round(rss_mb, 1),
    }  # fmt: skip


def table(found: dict[str, Any]) -> list[str]:
    """The results as markdown tables (ms: median / max)."""
    lines = [
        f"leader pass, {found['scenario']} ({SCENARIOS[found['start']][2]}): "
        f"{found['jobs']} waiting jobs, 2 leased jobs per worker, "
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
        "| populate s | assigned first / later | started | ledger | RSS MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_reads_row(size) for size in found["sizes"]]
    return lines


def _reads_row(size: dict[str, Any]) -> str:
    r = size["reads"]
    started = f"{size['started']} in {size['start_s']:.1f} s" if size["started"] else "0"
    return (
        f"| {size['workers']} | {r['leases']} "
        f"| {r['old_ms']['median']:.1f} / {r['old_ms']['max']:.1f} "
        f"| {r['feed_ms']['median']:.1f} / {r['feed_ms']['max']:.1f} | {r['ratio']:.1f} "
        f"| {r['reread_workers']:g} / {r['reread_leases']:g} | {size['populate_s']:.1f} "
        f"| {size['first_pass_assigned']} / {size['later_assigned']} "
        f"| {started} "
        f"| {size['ledger']} | {size['rss_mb']:.0f} |"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see module doc)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, nargs="+", default=[100, 1000, 10_000])
    parser.add_argument("--jobs", type=int, default=100_000, help="waiting jobs (100000)")
    parser.add_argument("--passes", type=int, default=11, help="passes per size (11)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of old/feed reads (10)")
    parser.add_argument("--changed", type=float, default=0.01, help="share changed per tick")
    parser.add_argument("--refreshed", type=float, default=0.1, help="share refreshed per tick")
    parser.add_argument(
        "--start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start each pass's assignments before the next (steady; default) or never",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--out", metavar="DIR", help="write the results' .json and .md there")
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
    scenario, stem, _ = SCENARIOS[args.start]
    found = {
        "scenario": scenario, "start": args.start, "jobs": args.jobs, "passes": args.passes,
        "rounds": args.rounds, "changed": args.changed, "refreshed": args.refreshed,
        "run_s": round(time.perf_counter() - began, 1), "sizes": sizes,
    }  # fmt: skip
    lines = table(found)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(found, indent=1) + "\n")
        (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
        draw(out)
    print(json.dumps(found, indent=2) if args.json else "\n".join(lines))
    return found


def draw(out: Path) -> None:
    """`leader_pass.png` in `out`, from the results of each scenario found there."""
    from bench.replay_plot import leader_pass_plot

    found = [json.loads((out / f"{stem}.json").read_text())
             for _, stem, _ in SCENARIOS.values() if (out / f"{stem}.json").exists()]  # fmt: skip
    leader_pass_plot(found, str(out / "leader_pass.png"))


if __name__ == "__main__":
    main()
