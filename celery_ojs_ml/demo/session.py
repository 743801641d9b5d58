"""One demo session on a running fleet: wait for the workers, submit, watch, judge.

Both modes share it: the embedded runner (in-process workers on `memory://`)
and the Redis runner (real worker processes) only differ in how the fleet is
started and stopped.

Key decision: jobs are submitted only once every node has advertised itself
in the store, because the router decides at publish whether any live worker
can ever run a job; submitting earlier would mark runnable jobs as waiting.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.demo.jobs import EXAMPLES, DemoJob, Submission, fleet_capabilities, load
from celery_ojs_ml.demo.table import LivePrinter
from celery_ojs_ml.demo.watch import DONE, WAITING, Row, judge, observe, settled
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore

POLL_S = 0.2


@dataclass
class Outcome:
    """What the session saw and what is wrong with it."""

    rows: list[Row]
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    waited: list[str] = field(default_factory=list)
    """Runnable jobs seen waiting with the scheduler's reason and start estimate."""

    @property
    def ok(self) -> bool:
        """Every runnable job ran where it may, and every other job waits with a reason."""
        return bool(self.rows) and not self.problems

    def as_dict(self) -> dict[str, Any]:
        """JSON form for `demo --report`."""
        return {
            "ok": self.ok,
            "problems": self.problems,
            "elapsed_s": round(self.elapsed_s, 2),
            "jobs": [r.as_dict() for r in self.rows],
            "waited_with_estimate": self.waited,
        }

    def write(self, path: Path) -> None:
        """Write the JSON report."""
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n", encoding="utf-8")


def fleet_banner(fleet: dict[str, Capabilities], pinning: str) -> list[str]:
    """One line per node: what it has."""
    lines = []
    for host, caps in fleet.items():
        labels = caps.derived_labels()
        if caps.gpu_count:
            what = f"{caps.gpu_count}x {labels.get('gpu_type')} {labels.get('gpu_memory_gb')} GB"
            link = labels.get("gpu_interconnect")
            what += f" ({link})" if link and caps.gpu_count > 1 else ""
        else:
            what = "no GPU"
        lines.append(f"  {host:<10} {what}, {caps.cpu_cores} cores, {caps.memory_gb:g} GB RAM")
    return [*lines, f"  GPU pinning: {pinning}"]


def wait_for_fleet(store: OJSStore, hostnames: Iterable[str], timeout_s: float) -> None:
    """Block until every node has advertised itself; ConfigError naming the missing ones."""
    wanted = set(hostnames)
    deadline = time.monotonic() + timeout_s
    while True:
        missing = wanted - set(store.live_workers())
        if not missing:
            return
        if time.monotonic() > deadline:
            raise ConfigError(
                f"worker(s) {', '.join(sorted(missing))} did not advertise within {timeout_s:g} s; "
                "start them with `celery -A celery_ojs_ml.demo.app worker -n a100@demo "
                "--ojs-ml-capabilities=profile:nvidia-a100x8` (and likewise l4@demo, cpu@demo)"
            )
        time.sleep(0.1)


def prepare(examples: Path = EXAMPLES) -> list[Submission]:
    """The demo's documents with ids unique to this run."""
    return load(uuid.uuid4().hex[:6], examples, fleet_capabilities())


def run(
    app: Celery,
    submissions: list[Submission],
    printer: LivePrinter,
    *,
    timeout_s: float,
) -> Outcome:
    """Submit every document, watch until nothing will change (or time out), judge."""
    store: OJSStore = app.ojs_ml.store
    jobs: list[DemoJob] = [j for s in submissions for j in s.jobs]
    printer.say(_leader_line(store))
    t0 = time.time()
    for sub in submissions:
        app.ojs_ml.submit(sub.doc)
    deadline = time.monotonic() + timeout_s
    rows = observe(app, store, jobs)
    waited: dict[str, None] = {}
    while not settled(rows) and time.monotonic() < deadline:
        printer.update(rows, t0, time.time())
        waited.update((r.job.label, None) for r in rows if r.job.runnable and r.estimate)
        time.sleep(POLL_S)
        rows = observe(app, store, jobs)
    printer.update(rows, t0, time.time())
    printer.finish(rows, t0)
    problems = judge(rows)
    if not settled(rows):
        problems.insert(0, f"the jobs did not settle within {timeout_s:g} s")
    done = {r.job.label for r in rows if r.state == DONE}
    return Outcome(rows, problems, time.time() - t0, [w for w in waited if w in done])


def _leader_line(store: OJSStore, timeout_s: float = 10.0) -> str:
    """Who leads the fleet scheduler (every worker is a candidate; one holds the lock)."""
    book = PendingBook(store)
    deadline = time.monotonic() + timeout_s
    while (leader := book.leader()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if leader is None:
        return f"Scheduler: no leader after {timeout_s:g} s (is ojs_ml_scheduler 'off' everywhere?)"
    return (
        f"Scheduler: {leader.get('id')} leads (elected through the store lock; "
        "every worker is a candidate)"
    )


def summary(outcome: Outcome) -> list[str]:
    """The closing lines: counts, then every problem, then OK or FAILED."""
    runnable = [r for r in outcome.rows if r.job.runnable]
    stuck = [r for r in outcome.rows if not r.job.runnable]
    done = sum(1 for r in runnable if r.state == DONE)
    explained = sum(1 for r in stuck if r.state == WAITING and r.reason)
    lines = [
        f"{len(runnable)} runnable job(s): {done} done on an eligible node; "
        f"{len(stuck)} job(s) no node can run: {explained} waiting with a reason "
        f"({outcome.elapsed_s:.1f} s)",
        f"{len(outcome.waited)} job(s) waited for capacity with the scheduler's reason and "
        f"start estimate, then ran: {', '.join(outcome.waited) or 'none'}",
        *(f"PROBLEM: {p}" for p in outcome.problems),
    ]
    lines.append("OK" if outcome.ok else "FAILED")
    return lines
