"""The chaos campaign's faults: a schedule drawn from the seed, and their injection.

The schedule (`schedule`) fixes, from `random.Random(seed)`, when each fault comes, of
which kind, on which worker and for how long; the order and kinds repeat for a seed,
the timing of the machine does not. Each fault runs in its own thread, so faults
overlap: a store restart during a stall, a kill during a partition. A fault on a worker
takes that worker's `busy` lock (another worker is picked, or the fault waits), and
every killed worker is started again at once.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from bench.chaos_fleet import ChaosWorker
from bench.chaos_servers import Proxy, RedisServer

KINDS = ("kill", "stall", "leader", "store", "broker", "partition")
RATES = {"kill": 2.2, "stall": 0.5, "leader": 0.4, "store": 0.3, "broker": 0.3, "partition": 0.4}
"""Faults per minute of the campaign; every kind comes at least once."""
MIN_KILLS = 4


@dataclass
class Fault:
    """One scheduled fault and, once injected, what happened."""

    at_s: float
    kind: str
    target: int
    hold_s: float
    t: float | None = None
    """Wall time (time.time()) of the injection."""
    end: float | None = None
    """Wall time the fault was lifted (the server answered, the worker was started again)."""
    worker: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def schedule(
    seed: int, minutes: float, workers: int, ttl_s: float, kinds: tuple[str, ...] = KINDS
) -> list[Fault]:
    """The faults of a campaign, in injection order."""
    rng = random.Random(seed)
    span = minutes * 60
    lo, hi = min(10.0, span * 0.1), span * 0.9
    faults = []
    for kind in kinds:
        count = max(1, round(RATES[kind] * minutes))
        count = max(count, MIN_KILLS) if kind == "kill" else count
        for _ in range(count):
            hold = ttl_s + rng.uniform(1.0, 3.0) if kind in ("stall", "partition") else 0.0
            if kind in ("store", "broker"):
                hold = rng.uniform(0.5, 2.0)
            faults.append(Fault(rng.uniform(lo, hi), kind, rng.randrange(workers), hold))
    return sorted(faults, key=lambda f: f.at_s)


class Injector:
    """Runs a schedule against the campaign's servers and workers."""

    def __init__(
        self,
        workers: list[ChaosWorker],
        servers: dict[str, RedisServer],
        proxies: dict[str, Proxy],
        leader_of: Callable[[], str | None],
        lock_ttl: Callable[[], int | None],
    ) -> None:
        self.workers, self.servers, self.proxies = workers, servers, proxies
        self.leader_of, self.lock_ttl = leader_of, lock_ttl
        self.done: list[Fault] = []
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def run(self, faults: list[Fault], began: float, stop: threading.Event) -> None:
        """Inject each fault at its time (in a thread of its own) until `stop`."""
        for fault in faults:
            delay = began + fault.at_s - time.monotonic()
            if delay > 0 and stop.wait(delay):
                return
            thread = threading.Thread(target=self._inject, args=(fault,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(120)

    def _inject(self, fault: Fault) -> None:
        try:
            getattr(self, f"_{fault.kind}")(fault)
            self.done.append(fault)
        except Exception as exc:  # a fault that could not be injected is reported
            self.errors.append(f"{fault.kind} at {fault.at_s:.1f} s: {exc!r}")

    def _pick(self, fault: Fault) -> ChaosWorker:
        """The scheduled worker, or the next one not under another fault (waits for one)."""
        n = len(self.workers)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for i in range(n):
                worker = self.workers[(fault.target + i) % n]
                if worker.alive() and worker.busy.acquire(blocking=False):
                    fault.worker = worker.name
                    return worker
            time.sleep(0.2)
        raise RuntimeError("no worker was running and free of other faults for 60 s")

    def _kill(self, fault: Fault) -> None:
        worker = self._pick(fault)
        try:
            fault.t = time.time()
            worker.kill()
            worker.start()
            fault.end = time.time()
        finally:
            worker.busy.release()

    def _stall(self, fault: Fault) -> None:
        worker = self._pick(fault)
        try:
            fault.t = time.time()
            worker.stall(fault.hold_s)
            fault.end = time.time()
        finally:
            worker.busy.release()

    def _partition(self, fault: Fault) -> None:
        worker = self._pick(fault)
        proxy = self.proxies[worker.name]
        try:
            fault.t = time.time()
            proxy.cut()
            time.sleep(fault.hold_s)
            proxy.heal()
            fault.end = time.time()
        finally:
            worker.busy.release()

    def _leader(self, fault: Fault) -> None:
        """SIGKILL the process that holds the scheduler lock (a worker's candidate)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            name = self.leader_of()
            worker = next((w for w in self.workers if w.hostname == name), None)
            pid = worker.candidate_pid() if worker is not None else None
            if worker is not None and pid is not None and worker.busy.acquire(blocking=False):
                try:
                    fault.t, fault.worker = time.time(), worker.name
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    fault.detail["pid"] = pid
                    fault.end = self._new_leader(name, time.monotonic() + 60)
                finally:
                    worker.busy.release()
                return
            time.sleep(0.2)
        raise RuntimeError("no worker's candidate held the scheduler lock for 30 s")

    def _new_leader(self, old: str | None, deadline: float) -> float | None:
        """Wall time a live candidate holds the lock: another one, or the same worker's new
        candidate (`worker.core` starts one when its process died), which renews the lock
        under the same name (its remaining TTL goes up again)."""
        last = self.lock_ttl()
        while time.monotonic() < deadline:
            now, ttl = self.leader_of(), self.lock_ttl()
            if now is not None and (
                now != old or (ttl is not None and (last is None or ttl > last))
            ):
                return time.time()
            last = ttl
            time.sleep(0.05)
        return None

    def _store(self, fault: Fault) -> None:
        self._restart(fault, self.servers["store"])

    def _broker(self, fault: Fault) -> None:
        self._restart(fault, self.servers["broker"])

    def _restart(self, fault: Fault, server: RedisServer) -> None:
        fault.t = time.time()
        fault.detail["down_s"] = round(server.restart(fault.hold_s), 3)
        fault.end = time.time()
