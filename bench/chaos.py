"""Chaos campaign: no job is lost and none runs twice at the same time, under faults.

Real `celery worker` processes (4 by default, prefork, simulated A100x2 each) on real
Redis servers of the campaign's own (free loopback ports): the broker and the store
with an append-only file, and a ledger that no fault touches (attempt events and the
result backend). A mixed workload runs for `--minutes`: checkpointed training jobs in
every band (`reserved`, `on-demand`, `spot`; reserved ones preempt spot ones), short
inference requests, and `--gangs` (2 by default) 2-rank gloo gangs. Meanwhile faults come in an
order drawn from `--seed` (`bench/chaos_faults.py`), overlapping each other:

* `kill`: SIGKILL of a whole worker (main process, pool children, scheduler
  candidate), started again at once; about 2 a minute;
* `stall`: SIGSTOP of a worker's main process for longer than the lease TTL, then
  SIGCONT (its pool children run on, as in a partition);
* `leader`: SIGKILL of the process holding the scheduler lock (a worker's spawned
  candidate; `store.leader_lock`);
* `store`, `broker`: a restart of the store or of the broker (SIGTERM, which fsyncs
  the AOF, then a start on the same port);
* `partition`: one worker cut off from the store for longer than the lease TTL
  by the TCP proxy it reaches the store through (`bench/chaos_servers.py`).

Then the faults stop, every worker runs, and the campaign waits for every job to end.
It reports (`bench/chaos_report.py`) jobs published, completed, failed with their
reasons and lost; attempts of one job that overlapped in time; jobs completed more
than once; and the recovery time after each kind of fault. Targets: 0 lost, 0
overlapping attempts, 0 checkpointed jobs completed twice. Exit status 1 on a miss.

    .venv/bin/python bench/chaos.py --minutes 15 --seed 1 [--json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import chaos_report  # noqa: E402
from bench.chaos_app import EVENTS, PREFIX, make_app  # noqa: E402
from bench.chaos_faults import KINDS, Injector, schedule  # noqa: E402
from bench.chaos_fleet import ChaosWorker  # noqa: E402
from bench.chaos_rabbit import RabbitServer  # noqa: E402
from bench.chaos_sentinel import SentinelStore  # noqa: E402
from bench.chaos_servers import Proxy, RedisServer  # noqa: E402
from celery_ojs_ml.store.deadletter import dead_jobs  # noqa: E402
from celery_ojs_ml.store.pending import PendingBook  # noqa: E402
from celery_ojs_ml.store.registry import OJSStore  # noqa: E402

LEASE_TTL_S = 3.0
BANDS = ("reserved", "on-demand", "spot")
MAX_OUTSTANDING = 24
"""Jobs not yet ended that the publisher allows at once (the machine has 2 cores)."""


class Campaign:
    """One campaign: servers, workers, workload, faults, drain, report."""

    def __init__(
        self, minutes: float, seed: int, workdir: Path, *, workers: int = 4, gangs: int = 0,
        drain_s: float = 240.0, topology: str = "split",
    ) -> None:  # fmt: skip
        self.minutes, self.seed, self.workdir = minutes, seed, workdir
        self.n_workers, self.gangs, self.drain_s = workers, gangs, drain_s
        self.rng = random.Random(seed + 1)
        self.jobs: dict[str, dict[str, Any]] = {}
        self.unpublished = 0
        self.refused: set[str] = set()
        self.stop = threading.Event()
        self.over = threading.Event()
        self.exits: list[dict[str, Any]] = []
        self.topology = topology
        self.servers: dict[str, Any] = {
            "ledger": RedisServer("ledger", workdir, aof=False),
            "broker": RabbitServer("broker", workdir)
            if topology == "rabbitmq"
            else RedisServer("broker", workdir),
        }
        self.servers["store"] = {
            "split": lambda: RedisServer("store", workdir),
            "rabbitmq": lambda: RedisServer("store", workdir),
            "shared": lambda: self.servers["broker"],
            "sentinel": lambda: SentinelStore(workdir),
        }[topology]()
        self.proxies: dict[str, Proxy] = {}
        self.workers: list[ChaosWorker] = []

    # -- set-up -------------------------------------------------------------------------------

    def start(self) -> None:
        ckpt = self.workdir / "ckpt"
        os.environ["CHAOS_CKPT"] = str(ckpt)  # the publisher's task options name it too
        for server in self._unique_servers():
            server.start()
        self.ledger = redis.Redis.from_url(self.servers["ledger"].url)
        broker, store = self.servers["broker"], self.servers["store"]
        self.store = OJSStore.from_url(store.url, prefix=PREFIX, options=self._options())
        self.app = make_app(broker.url, store.url, None, self._conf())
        for i in range(self.n_workers):
            name = f"w{i}"
            env = {
                "CHAOS_BROKER": broker.url,
                "CHAOS_STORE": store.url,
                "CHAOS_LEDGER": self.servers["ledger"].url,
                "CHAOS_CKPT": str(ckpt),
                "CHAOS_CONF": json.dumps(self._conf()),
                "GLOO_SOCKET_IFNAME": "lo",
            }
            if self.topology != "sentinel":  # a worker reaches the store through its proxy
                proxy = self.proxies[name] = Proxy(store.port)
                env["CHAOS_STORE"] = proxy.url()
                if self.topology == "shared":
                    env["CHAOS_BROKER"] = proxy.url()
            self.workers.append(ChaosWorker(name, env, self.workdir, concurrency=3))
        for worker in self.workers:
            worker.start()
        self._wait("every worker to advertise", self._all_live, 240)  # a loaded machine
        self._wait("a scheduler to be elected", self.leader, 60)

    def _unique_servers(self) -> list[Any]:
        return list({id(s): s for s in self.servers.values()}.values())

    def _options(self) -> dict[str, Any] | None:
        return self.servers["store"].options if self.topology == "sentinel" else None

    def _conf(self) -> dict[str, Any]:
        """Settings of every app: behind Sentinel, the store's master name, and a wait for
        the replica after the writes a failover must not undo (docs/operations.md)."""
        if self.topology != "sentinel":
            return {}
        return {"ojs_ml_store_transport_options": self._options(), "ojs_ml_store_wait_replicas": 1}

    def _all_live(self) -> bool:
        live = self.store.live_workers()
        return all(w.hostname in live for w in self.workers)

    def leader(self) -> str | None:
        try:
            found = PendingBook(self.store).leader()
        except redis.RedisError:
            return None
        return None if found is None else str(found.get("id"))

    def lock_ttl(self) -> int | None:
        """The scheduler lock's remaining TTL in ms (None: no lock, or no answer)."""
        try:
            ttl = int(self.store.client.pttl(self.store.key("scheduler", "leader")))
        except redis.RedisError:
            return None
        return ttl if ttl >= 0 else None

    def _wait(self, what: str, check: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                tails = "\n".join(f"{w.name}: {w.tail(1500)}" for w in self.workers)
                raise RuntimeError(f"timed out waiting for {what}\n{tails}")
            time.sleep(0.2)

    def supervise(self) -> None:
        """Start a worker again that exited on its own, as a supervisor would (systemd's
        `Restart=always`), and note when and why it exited."""
        while not self.over.wait(1.0):
            for worker in self.workers:
                if worker.alive() or not worker.busy.acquire(blocking=False):
                    continue
                try:
                    if worker.proc is not None and worker.proc.poll() is not None:
                        why = worker.exit_reason()
                        self.exits.append({"worker": worker.name, "t": time.time(), "why": why})
                        worker.start()
                finally:
                    worker.busy.release()

    # -- workload -----------------------------------------------------------------------------

    def publish_loop(self) -> None:
        """Publish a mixed workload until `stop`, keeping at most `MAX_OUTSTANDING` open."""
        gangs_at = sorted(self.rng.uniform(0.2, 0.6) * self.minutes * 60 for _ in range(self.gangs))
        began = time.monotonic()
        while not self.stop.wait(self.rng.uniform(0.4, 1.2)):
            if self._outstanding() >= MAX_OUTSTANDING:
                continue
            if gangs_at and time.monotonic() - began > gangs_at[0]:
                gangs_at.pop(0)
                self._publish_gang()
            elif self.rng.random() < 0.04:  # spot jobs that fill the fleet: preemption ahead
                for _ in range(2 * self.n_workers):
                    self._publish("train", "chaos.train", [20, 0.5], "spot")
            elif self.rng.random() < 0.35:
                band = self.rng.choices(BANDS, weights=(2, 4, 4))[0]
                args = [self.rng.randint(6, 16), round(self.rng.uniform(0.3, 0.6), 2)]
                self._publish("train", "chaos.train", args, band)
            else:
                for _ in range(self.rng.randint(1, 3)):
                    args = [self.rng.randint(0, 1000), self.rng.randint(50, 400)]
                    self._publish("infer", "chaos.infer", args, self.rng.choice(BANDS))

    def _outstanding(self) -> int:
        ids = list(self.jobs)
        if not ids:
            return 0
        metas = self.ledger.mget([f"celery-task-meta-{i}" for i in ids])
        return sum(m is None for m in metas)

    def _publish(self, kind: str, name: str, args: list[Any], band: str) -> None:
        """Publish one job; a publish the broker or the store refused is tried again under
        a new id (the refused one is counted, and must never run)."""
        headers = {"ext_ml_priority_class": band}
        for _ in range(200):
            task_id = str(uuid.uuid4())
            try:
                self.app.tasks[name].apply_async(args=args, headers=headers, task_id=task_id)
            except Exception:
                self.unpublished += 1
                self.refused.add(task_id)
                if self.stop.wait(0.5):
                    return
                continue
            self.jobs[task_id] = {"kind": kind, "band": band, "at": time.time()}
            return

    def _publish_gang(self) -> None:
        sig = self.app.tasks["chaos.gang"].s(self.rng.randint(10, 16), 0.5)
        for _ in range(100):
            try:
                ranks = self.app.ojs_ml.gang(sig, 2)
            except Exception:
                self.unpublished += 1
                time.sleep(0.5)
                continue
            for child in ranks.results:
                self.jobs[child.id] = {"kind": "gang", "band": "on-demand", "at": time.time()}
            return

    # -- the campaign -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        began = time.monotonic()
        self.start()
        injector = Injector(self.workers, self.servers, self.proxies, self.leader, self.lock_ttl)
        kinds = tuple(k for k in KINDS if k != "partition" or self.topology != "sentinel")
        faults = schedule(self.seed, self.minutes, self.n_workers, LEASE_TTL_S, kinds)
        publisher = threading.Thread(target=self.publish_loop, daemon=True)
        publisher.start()
        threading.Thread(target=self.supervise, daemon=True).start()
        t0 = time.monotonic()
        injector_thread = threading.Thread(
            target=injector.run, args=(faults, t0, self.stop), daemon=True
        )
        injector_thread.start()
        self.stop.wait(self.minutes * 60)
        self.stop.set()
        publisher.join(60)
        injector_thread.join(60)
        injector.join()
        self._heal()
        drained = self._drain()
        self.over.set()
        return self._report(injector, began, drained)

    def _heal(self) -> None:
        """Every proxy open, every server and worker running."""
        for proxy in self.proxies.values():
            proxy.heal()
        for worker in self.workers:
            with worker.busy:  # not beside the supervisor's own restart
                if not worker.alive():
                    worker.start()

    def _drain(self) -> float:
        """Wait until every published job ended (or `drain_s` passed); returns seconds."""
        began = time.monotonic()
        while time.monotonic() - began < self.drain_s:
            if self._outstanding() == 0:
                break
            time.sleep(1.0)
        return time.monotonic() - began

    def _states(self) -> dict[str, dict[str, Any]]:
        ids = list(self.jobs)
        raws = self.ledger.mget([f"celery-task-meta-{i}" for i in ids]) if ids else []
        return {i: json.loads(r) for i, r in zip(ids, raws, strict=True) if r}

    def _report(self, injector: Injector, began: float, drained: float) -> dict[str, Any]:
        events = [json.loads(e) for e in self.ledger.lrange(EVENTS, 0, -1)]
        try:
            dead = {d["task_id"]: d["reason"] for d in dead_jobs(self.store)}
        except redis.RedisError:
            dead = {}
        summary = chaos_report.summarise(self.jobs, events, self._states(), dead)
        runs = chaos_report.attempts(events)
        done = sorted(injector.done, key=lambda f: f.t or 0.0)
        for lost in summary["lost"]:
            lost["where"] = self._where(lost["job"])
        return {
            "minutes": self.minutes,
            "seed": self.seed,
            "workers": self.n_workers,
            "topology": self.topology,
            "wall_s": round(time.monotonic() - began, 1),
            "drain_s": round(drained, 1),
            "unpublished_attempts": self.unpublished,
            "refused_but_ran": sorted(self.refused & set(runs)),
            "faults": {k: sum(f.kind == k for f in done) for k in chaos_report.KINDS},
            "fault_errors": injector.errors,
            "worker_exits": self.exits,
            "fault_log": [
                {"kind": f.kind, "worker": f.worker, "t": f.t, "end": f.end, **f.detail}
                for f in done
            ],
            "recovery": chaos_report.recovery(done, events, runs),
            "summary": summary,
            "verdict": chaos_report.verdict(summary),
        }

    def _where(self, task_id: str) -> dict[str, Any]:
        """Where a lost job still is, for whoever debugs it."""
        try:
            return {
                "pending": PendingBook(self.store).get(task_id),
                "lease": self.store.client.get(self.store.lease_key(task_id)),
            }
        except redis.RedisError as exc:
            return {"error": repr(exc)}

    def close(self) -> None:
        self.over.set()
        for worker in self.workers:
            worker.stop()
        for proxy in self.proxies.values():
            proxy.close()
        for server in self._unique_servers():
            server.stop()


def run_campaign(
    minutes: float, seed: int, workdir: Path | None = None, **options: Any
) -> dict[str, Any]:
    """Run one campaign in `workdir` (a temporary one, removed, when None)."""
    own = workdir is None
    folder = Path(tempfile.mkdtemp(prefix="ojs-chaos-")) if workdir is None else workdir
    campaign = Campaign(minutes, seed, folder, **options)
    try:
        report = campaign.run()
    finally:
        campaign.close()
    if own and report["verdict"]["pass"]:
        shutil.rmtree(folder, ignore_errors=True)
    report["workdir"] = None if own and report["verdict"]["pass"] else str(folder)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--gangs", type=int, default=2, help="2-rank gloo gangs to publish")
    parser.add_argument("--drain", type=float, default=240.0, help="seconds to wait at the end")
    parser.add_argument(
        "--topology",
        choices=("split", "shared", "sentinel", "rabbitmq"),
        default="split",
        help="split: store and broker on their own servers; shared: the store is the "
        "broker's Redis (grants on); sentinel: the store behind Sentinel (failovers); "
        "rabbitmq: as split, with a RabbitMQ node of the campaign's own as the broker",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and data here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = run_campaign(
        args.minutes, args.seed, args.workdir,
        workers=args.workers, gangs=args.gangs, drain_s=args.drain, topology=args.topology,
    )  # fmt: skip
    print(json.dumps(report, indent=1, default=str) if args.json else chaos_report.table(report))
    return 0 if report["verdict"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
