"""The workers' side of `bench/leader_pass.py`: the fleet its leader schedules.

`fleet` fills a fresh key prefix as `bench.metrics.populate` does, admits the waiting
jobs, and removes every key of the prefix afterwards (a shared `--redis-url` outlives
the run). `Workers` is the workers' own `OJSStore` (which remembers what each worker
sent, so only a changed heartbeat goes to the change feed), what each worker advertises
and the leases it keeps:

* `tick`   the churn between two passes (see `leader_pass`);
* `start`  what a pass assigned, started as the workers' gates would within
           milliseconds of the delivery: the gate's START script moves each record
           `assigned` -> `started` (fenced by the token in the record), a lease is
           written with the job record, and the worker advertises the GPUs allocated
           (its `Allocator`'s snapshot). Each step is pipelined or batched, so 20,000
           starts take seconds.
"""

from __future__ import annotations

import base64
import json
import random
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.metrics import _pending, populate
from celery_ojs_ml.allocator import Allocation, Allocator
from celery_ojs_ml.capabilities import resolve_capabilities
from celery_ojs_ml.scheduler.model import Assignment
from celery_ojs_ml.spec.classes import class_id
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.pending import TOMBSTONE_S, PendingBook
from celery_ojs_ml.store.pending_records import job_key
from celery_ojs_ml.store.pending_scripts import START
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.records import job_record

OK = (b"ok", "ok")
"""The START script's reply to a start (bytes or text, as the client decodes)."""
HOUR_S = 3600.0
"""Heartbeats and leases outlive the run, as `populate` writes them."""
ADMIT_BATCH = 5000
WRITE_BATCH = 2000
"""Starts, leases or heartbeats per round trip: one Lua call writing 20,000 leases
would hold the server for all of them at once."""
CAPS = resolve_capabilities("profile:nvidia-a100x8")
RUNNING_REQ = normalize({"ext_ml_gpu_count": 2}).requirements
"""What `populate`'s running jobs asked of their workers' allocators."""
JOB_REQ = normalize({"ext_ml_gpu_count": 2, "ext_ml_gpu_type": "nvidia-a100"}).requirements
JOB_CLASS = class_id(JOB_REQ)
"""The class the router gives `populate`'s jobs, whose placeholder class the leader refuses."""


def admit(store: OJSStore, jobs: int) -> None:
    """`jobs` waiting 2-GPU jobs as `populate` makes them, with the class their headers ask."""
    book = PendingBook(store)
    for start in range(0, jobs, ADMIT_BATCH):
        batch = [_pending(i) for i in range(start, min(jobs, start + ADMIT_BATCH))]
        for _, _, msg in batch:
            msg["headers"][h.CLASS] = JOB_CLASS
        book.admit_many(batch)


@contextmanager
def fleet(url: str, workers: int, jobs: int, changed: float, refreshed: float) -> Iterator[Workers]:
    """`workers` busy workers and `jobs` waiting jobs under a fresh prefix on `url`."""
    prefix = f"lp-{uuid.uuid4().hex[:6]}"
    side = OJSStore.from_url(url, prefix=prefix)
    try:
        populate(side, workers, 0)
        admit(side, jobs)
        PendingBook(side).resign("leader@fleet")  # `populate`'s stand-in leader
        yield Workers.of(side, prefix, changed, refreshed)
    finally:
        keys = list(side.client.scan_iter(match=f"{prefix}*", count=10_000))
        for start in range(0, len(keys), 10_000):
            side.client.unlink(*keys[start : start + 10_000])
        side.close()


@dataclass
class Workers:
    """The workers' side of the fleet: their own store and what each advertises."""

    store: OJSStore
    prefix: str
    beats: dict[str, dict[str, Any]]
    leases: dict[str, list[dict[str, Any]]]
    shares: tuple[float, float]
    """(changed, refreshed) share of the workers per tick."""
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    busier: set[str] = field(default_factory=set)
    """Workers now advertising `_busier` snapshots."""
    allocators: dict[str, Allocator] = field(default_factory=dict)
    """The allocators of the workers that started a job here (`_allocator`)."""

    @classmethod
    def of(cls, store: OJSStore, prefix: str, changed: float, refreshed: float) -> Workers:
        """The fleet `populate` wrote, read back as each worker last sent it."""
        beats = {
            name: {k: entry[k] for k in ("capabilities", "free", "info")}
            for name, entry in store.live_workers().items()
        }
        leases: dict[str, list[dict[str, Any]]] = {}
        for lease in LeaseBook(store, HOUR_S).all():
            leases.setdefault(str(lease["worker"]), []).append(lease)
        return cls(store, prefix, beats, leases, (changed, refreshed))

    def free(self, name: str) -> dict[str, Any]:
        """The allocator snapshot `name` advertises now."""
        free = self.beats[name]["free"]
        return _busier(free, name) if name in self.busier else free

    def advertise(self, names: Iterable[str]) -> None:
        """Heartbeats of `names`, pipelined."""
        names = list(names)
        for at in range(0, len(names), WRITE_BATCH):
            with self.store.client.pipeline(transaction=False) as pipe:
                for name in names[at : at + WRITE_BATCH]:
                    beat = self.beats[name]
                    for command in self.store.advertise_commands(
                        name, beat["capabilities"], self.free(name), ttl_s=HOUR_S, info=beat["info"]
                    ):
                        pipe.execute_command(*command)  # type: ignore[no-untyped-call]
                pipe.execute()

    def tick(self) -> None:
        """Heartbeats and lease refreshes between two passes (see `leader_pass`)."""
        names = list(self.beats)
        changes = max(1, round(self.shares[0] * len(names)))
        refreshes = round(self.shares[1] * len(names))
        picked = self.rng.sample(names, min(len(names), changes + refreshes))
        changed, refreshed = picked[:changes], picked[changes:]
        self.busier.symmetric_difference_update(changed)
        self.advertise(picked)
        book = LeaseBook(self.store, HOUR_S)
        book.refresh({x["task_id"]: x["token"] for n in refreshed for x in self.leases[n]})
        again = [book.new_lease(x, x["token"])[1] for n in changed for x in self.leases[n]]
        book.write_batch(again, [])

    def start(self, assignments: Sequence[Assignment]) -> int:
        """Start every assignment of a pass as its worker's gate would (module doc)."""
        if not assignments:
            return 0
        records = PendingBook(self.store).read([a.task_id for a in assignments], lean=False)
        self._claim(assignments, records)
        book = LeaseBook(self.store, HOUR_S)
        takes = [self._run(a, records[a.task_id], book) for a in assignments]
        for at in range(0, len(takes), WRITE_BATCH):
            book.write_batch(takes[at : at + WRITE_BATCH], [])
        names = sorted({a.worker for a in assignments})
        for name in names:
            self.beats[name]["free"] = self.allocators[name].snapshot()
        self.advertise(names)
        return len(assignments)

    def _claim(
        self, assignments: Sequence[Assignment], records: Mapping[str, dict[str, Any]]
    ) -> None:
        """`PendingBook.start` of each assignment, pipelined; stops the run unless each is
        assigned to its worker and starts."""
        script = self.store.client.register_script(START)
        index = PendingBook(self.store).index_key
        outcomes: list[Any] = []
        for at in range(0, len(assignments), WRITE_BATCH):
            with self.store.client.pipeline(transaction=False) as pipe:
                for a in assignments[at : at + WRITE_BATCH]:
                    record = records.get(a.task_id) or {}
                    if record.get("worker") != a.worker:
                        raise RuntimeError(f"{a.task_id} is not assigned to {a.worker}: {record}")
                    args = [record["token"], repr(time.time()), TOMBSTONE_S, a.task_id]
                    script(keys=[job_key(self.store, a.task_id), index], args=args, client=pipe)
                outcomes += pipe.execute()
        failed = [(a.task_id, o) for a, o in zip(assignments, outcomes, strict=True) if o not in OK]
        if failed:
            raise RuntimeError(f"{len(failed)} assignment(s) did not start, e.g. {failed[:3]}")
        self.store.replicated()  # as the gate: a start a failover undid would run it twice

    def _run(
        self, a: Assignment, record: Mapping[str, Any], book: LeaseBook
    ) -> tuple[str, str, float]:
        """The job's GPUs on its worker's allocator, and its lease to write."""
        alloc = self._allocator(a.worker).try_alloc(a.task_id, a.task_id, JOB_REQ)
        if not isinstance(alloc, Allocation):
            raise RuntimeError(f"{a.task_id} does not fit on {a.worker}: {alloc}")
        msg = record["msg"]
        args, kwargs, _ = json.loads(base64.b64decode(msg["body"]))
        headers = msg["headers"]
        job = job_record(a.task_id, headers.get("task"), args, kwargs, headers)
        devices = list(alloc.devices)
        lease = {**job, "worker": a.worker, "devices": devices, "started_at": time.time()}
        _, take = book.new_lease(lease)
        self.leases.setdefault(a.worker, []).append(json.loads(take[1]))
        return take

    def _allocator(self, name: str) -> Allocator:
        """The worker's allocator, holding the jobs `populate` leased there on their devices."""
        found = self.allocators.get(name)
        if found is None:
            found = self.allocators[name] = Allocator(CAPS)
            for lease in self.leases.get(name, []):
                task_id = str(lease["task_id"])
                found.try_alloc(task_id, task_id, RUNNING_REQ, prefer=[lease["devices"]])
        return found


def _busier(free: dict[str, Any], name: str) -> dict[str, Any]:
    """`free` with one more 2-GPU job on its first two free devices; on a full worker, its
    newest job's devices taken by another (that job ended, and the worker started one of
    its own). A change the feed must carry, and no GPU freed for the leader to fill."""
    task_id = f"{name}/extra"
    idle = [d for d, owner in free["devices"].items() if owner is None][:2]
    allocations = list(free["allocations"])
    counts = dict(free["free"])
    if len(idle) == 2:
        extra = {**allocations[0], "task_id": task_id, "devices": [int(d) for d in idle]}
        counts["gpu_count"] -= 2
    else:
        ended = allocations.pop()
        extra = {**ended, "task_id": task_id}
        idle = [str(d) for d in ended["devices"]]
    devices = {**free["devices"], **dict.fromkeys(idle, task_id)}
    return {**free, "allocations": [*allocations, extra], "free": counts, "devices": devices}
