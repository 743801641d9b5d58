"""Metrics benchmark: the cost of one `celery ojs-ml metrics` scrape on a large fleet.

A Redis (a private `redis-server` unless `--redis-url`) is filled through the
store's own write functions with a fleet of `--workers` advertised 8-GPU workers,
each running two 2-GPU jobs (allocations from the real allocator, one lease per job),
`--pending` waiting jobs in the pending set (3 bands, 8 logical queues, messages as
the intake stores them), a leader lock with its last pass, a budget report, 50
dead letters and 10 reservations. The exporter then serves on a free port, and
`/metrics` is fetched over HTTP:

* cold     the first scrape: every waiting job's band and queue and every running
           job's lease are read (two round trips);
* steady   nothing changed since the last scrape (one round trip);
* churn    1 % of the waiting jobs replaced before each scrape (two round trips,
           the second for the new jobs only).

Reports the median and p95 over `--scrapes` scrapes (target <= 100 ms per steady
scrape), the response size and its series count.

    .venv/bin/python bench/metrics.py [--workers 1000] [--pending 10000] [--scrapes 20]
        [--json] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from celery_ojs_ml.allocator import Allocator  # noqa: E402
from celery_ojs_ml.capabilities import capabilities_to_dict, resolve_capabilities  # noqa: E402
from celery_ojs_ml.exporter import Exporter  # noqa: E402
from celery_ojs_ml.spec.classes import BANDS  # noqa: E402
from celery_ojs_ml.spec.normalize import normalize  # noqa: E402
from celery_ojs_ml.store.deadletter import dead_letter  # noqa: E402
from celery_ojs_ml.store.leases import LeaseBook  # noqa: E402
from celery_ojs_ml.store.pending import PendingBook  # noqa: E402
from celery_ojs_ml.store.registry import OJSStore  # noqa: E402
from celery_ojs_ml.store.reservations import ReservationBook  # noqa: E402
from celery_ojs_ml.wire import headers as h  # noqa: E402
from celery_ojs_ml.wire.records import job_record  # noqa: E402

TARGET_MS = 100.0
QUEUES = tuple(f"queue-{i}" for i in range(8))
_START_TIMEOUT_S = 10.0
_TTL_S = 3600.0
"""Heartbeats outlive the run."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def private_redis() -> Iterator[str]:
    """A throwaway `redis-server` on a free loopback port, persistence off."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not on PATH; install it or pass --redis-url")
    port = _free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        with redis.Redis.from_url(url) as client:
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        sys.exit(f"redis-server at {url} did not answer")
                    time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=5)


def _headers(task_id: str, i: int) -> dict[str, Any]:
    """A GPU job's message headers as a producer's router leaves them."""
    return {
        "lang": "py", "task": "train.step", "id": task_id, "shadow": None, "eta": None,
        "expires": None, "group": None, "group_index": None, "retries": 0,
        "timelimit": [None, None], "root_id": task_id, "parent_id": None,
        "argsrepr": f"('run-{i}', 100)", "kwargsrepr": "{}", "origin": "gen1@producer",
        "ignore_result": False, "stamped_headers": None, "stamps": {},
        "ext_ml_gpu_count": 2, "ext_ml_gpu_type": "nvidia-a100",
        h.CLASS: "c0ffee" * 5, h.BAND: BANDS[i % len(BANDS)],
        h.LOGICAL: QUEUES[i % len(QUEUES)], h.MSG: uuid.uuid4().hex,
    }  # fmt: skip


def _pending(i: int) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(task id, meta, message) of one waiting job, as the intake admits it."""
    task_id = str(uuid.uuid4())
    headers = _headers(task_id, i)
    body = base64.b64encode(json.dumps([[f"run-{i}", 100], {}, {}]).encode()).decode()
    msg = {"body": body, "content_type": "application/json", "content_encoding": "utf-8",
           "headers": headers, "properties": {"priority": 0}}  # fmt: skip
    meta = {"task": "train.step", "queue": headers[h.LOGICAL], "band": headers[h.BAND],
            "gpus": 2, "priority": 0, "submitted_at": time.time(),
            "time_limit_s": 3600.0}  # fmt: skip
    return task_id, meta, msg


def populate(store: OJSStore, workers: int, pending: int) -> None:
    """The fleet, through the store's own writes (see module doc)."""
    caps = resolve_capabilities("profile:nvidia-a100x8")
    doc = capabilities_to_dict(caps)
    req = normalize({"ext_ml_gpu_count": 2}).requirements
    leases = LeaseBook(store, _TTL_S)
    for w in range(workers):
        allocator = Allocator(caps)
        name = f"gpu-{w:04d}@fleet"
        for j in range(2):
            task_id = str(uuid.uuid4())
            allocator.try_alloc(task_id, task_id, req)
            headers = _headers(task_id, w * 2 + j)
            record = job_record(task_id, "train.step", [f"run-{w}", 100], {}, headers)
            leases.take({**record, "worker": name, "devices": [2 * j, 2 * j + 1]})
        info = {"queues": list(QUEUES), "task_events": True, "processes": 8}
        store.advertise(name, doc, allocator.snapshot(), ttl_s=_TTL_S, info=info)
    book = PendingBook(store)
    for start in range(0, pending, 500):
        book.admit_many([_pending(i) for i in range(start, min(pending, start + 500))])
    book.lead("leader@fleet", _TTL_S)
    book.lead("leader@fleet", _TTL_S, pass_s=0.042)
    budgets = {q: {"gpus": 16, "max_total_gpus": 64, "jobs": 8} for q in QUEUES[:2]}
    store.client.set(store.key("scheduler", "budgets"), json.dumps(budgets))
    logging.getLogger("celery_ojs_ml.store.deadletter").setLevel(logging.CRITICAL)
    for i in range(50):
        task_id = str(uuid.uuid4())
        dead_letter(store, job_record(task_id, "train.step", [], {}, _headers(task_id, i)), "x")
    for i in range(10):
        ReservationBook(store).create(f"res-{i}", {"ext_ml_gpu_count": 8}, None)


def churn(store: OJSStore, count: int, step: int) -> None:
    """Replace `count` waiting jobs: cancel the oldest, admit as many new ones."""
    book = PendingBook(store)
    oldest: Any = store.client.zrange(book.index_key, 0, count - 1)
    for raw in oldest:
        book.cancel(raw.decode())
    book.admit_many([_pending(step * count + i) for i in range(count)])


def _scrape(url: str) -> tuple[float, bytes]:
    began = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        body = response.read()
    return (time.perf_counter() - began) * 1000, body


def measure(url: str, scrapes: int, before: Callable[[int], None] | None) -> list[float]:
    """Milliseconds of `scrapes` scrapes; `before(i)` runs untimed before scrape i."""
    found = []
    for i in range(scrapes):
        if before is not None:
            before(i)
        found.append(_scrape(url)[0])
    return found


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def run(redis_url: str, workers: int, pending: int, scrapes: int) -> dict[str, Any]:
    """Populate, serve, scrape; the figures as a JSON-able dict."""
    store = OJSStore.from_url(redis_url, prefix=f"bench-{uuid.uuid4().hex[:6]}")
    began = time.perf_counter()
    populate(store, workers, pending)
    filled_s = time.perf_counter() - began
    exporter = Exporter(store, None, port=0)
    url = f"http://127.0.0.1:{exporter.start()}/metrics"
    try:
        cold_ms, body = _scrape(url)
        steady = measure(url, scrapes, None)
        moved = max(1, pending // 100)
        churned = measure(url, scrapes, lambda i: churn(store, moved, i))
    finally:
        exporter.stop()
        for key in store.client.scan_iter(match=store.key("*")):
            store.client.delete(key)
        store.close()
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    rows = {"cold": [cold_ms], "steady": steady, "churn": churned}
    return {
        "workers": workers, "pending": pending, "running": 2 * workers, "scrapes": scrapes,
        "populate_s": round(filled_s, 2), "bytes": len(body), "series": series,
        "target_ms": TARGET_MS,
        "ms": {k: {"median": round(statistics.median(v), 2), "p95": round(_p95(v), 2)}
               for k, v in rows.items()},
        "pass": statistics.median(steady) <= TARGET_MS,
    }  # fmt: skip


def report(found: dict[str, Any]) -> None:
    """The table."""
    print(
        f"metrics scrape: {found['workers']} workers, {found['running']} running, "
        f"{found['pending']} waiting jobs; {found['series']} series, {found['bytes']} bytes"
    )
    print(f"{'scrape':<8} {'median ms':>10} {'p95 ms':>10}")
    for name, row in found["ms"].items():
        print(f"{name:<8} {row['median']:>10.1f} {row['p95']:>10.1f}")
    verdict = "PASS" if found["pass"] else "MISS"
    print(f"steady median vs target {found['target_ms']:.0f} ms: {verdict}")


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    parser.add_argument("--workers", type=int, default=1000, help="live workers (default 1000)")
    parser.add_argument("--pending", type=int, default=10_000, help="waiting jobs (10000)")
    parser.add_argument("--scrapes", type=int, default=20, help="timed scrapes per row (20)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.redis_url:
        found = run(args.redis_url, args.workers, args.pending, args.scrapes)
    else:
        with private_redis() as url:
            found = run(url, args.workers, args.pending, args.scrapes)
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        report(found)


if __name__ == "__main__":
    main()
