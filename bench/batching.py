"""Dynamic batching benchmark: the plugin with `ml_batch` against the hand-made baseline.

One simulated GPU (`bench/batching_app.py`: a call costs `--base-ms + --per-item-ms * n`
for n requests; CUDA init 0.3 s and model load 1 s once per process), 1-GPU
inference requests, on:

1. `plugin-batch`: the plugin with its defaults, one 1-GPU worker (`-c 1`, warm
   children), the task declared with `ml_batch={"max_size": 32, "max_wait_ms": 5}`;
2. `baseline`: the setup a user builds by hand: one plain Celery worker per GPU,
   `CUDA_VISIBLE_DEVICES=0 -c 1`, the model loaded in `worker_process_init`, one
   request per call (the same cost model with n = 1);
3. `plugin-single` (on request): the plugin with `max_size` 1, one request per call;
4. `plugin-leader` (on request): `plugin-batch` with `-c 1`, so the scheduler never
   grants the class to the worker (a grant needs a free pool process) and every
   request goes through its passes, with `ojs_ml_prefetch = 31` and
   `ojs_ml_reservation_depth = 32` (a job is sent ahead only once a pass plans it
   there): the requests a busy worker's gate holds ahead are what a batch fills from.

Each variant, on a fresh worker: a warm-up of 8 requests (not measured), then

* **burst**: `--burst` requests published back to back; throughput = requests /
  (last end - first publish);
* **steady**: requests published at `--rate` per second for `--steady-s` seconds
  (open loop); latency = end of the call that served the request - its publish;
* **one at a time**: `--sequential` requests, each published when the last ended.

Both variants store each request's result in the Redis result backend and record
timings from the task body. Target: `plugin-batch` throughput >= 3x the baseline's.

    .venv/bin/python bench/batching.py [--burst 640] [--rate 30] [--json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dispatch import private_redis  # noqa: E402

RESULTS_KEY = "ojs-bench:batching"
VARIANTS = ("plugin-batch", "baseline")
TARGET = 3.0


def start_worker(
    variant: str, broker: str, logdir: Path, args: argparse.Namespace
) -> subprocess.Popen[bytes]:
    """The variant's one worker (it logs to `logdir`)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **_env(variant, broker, args), "PYTHONPATH": path}
    argv = [sys.executable, "-m", "celery", "-A", "bench.batching_app", "worker", "-P",
            "prefork", "-l", "WARNING", "--without-gossip", "--without-mingle",
            "-n", f"gpu@{variant}"]  # fmt: skip
    if variant == "baseline":
        env["CUDA_VISIBLE_DEVICES"] = "0"
        argv += ["-c", "1"]  # a second process would run a second call on the GPU at once
    else:  # a spare process lets the scheduler grant the class (the gate runs one call)
        processes = "1" if variant == "plugin-leader" else "2"
        argv += ["-c", processes, "--ojs-ml-capabilities=profile:nvidia-a100x1"]
    out = (logdir / f"{variant}.log").open("wb")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return proc


def _env(variant: str, broker: str, args: argparse.Namespace) -> dict[str, str]:
    return {
        "OJS_BENCH_BROKER": broker,
        "OJS_BENCH_PLUGIN": "0" if variant == "baseline" else "1",
        "OJS_BENCH_BASE_MS": str(args.base_ms),
        "OJS_BENCH_PER_ITEM_MS": str(args.per_item_ms),
        "OJS_BENCH_MAX_SIZE": "1" if variant == "plugin-single" else str(args.max_size),
        "OJS_BENCH_MAX_WAIT_MS": str(args.max_wait_ms),
        "OJS_BENCH_CONF": json.dumps(_leader_conf(args.max_size, variant)),
    }


def _leader_conf(max_size: int, variant: str) -> dict[str, int]:
    """`plugin-leader`: up to a batch's worth of requests sent ahead to the busy worker."""
    if variant != "plugin-leader":
        return {}
    return {"ojs_ml_prefetch": max_size - 1, "ojs_ml_reservation_depth": max_size}


def run_variant(
    variant: str, broker: str, args: argparse.Namespace, logdir: Path
) -> dict[str, Any]:
    os.environ.update(_env(variant, broker, args))
    import bench.batching_app as mod

    mod = importlib.reload(mod)  # the publisher's app: with the plugin or without
    client = redis.Redis.from_url(broker)
    client.flushdb()
    proc = start_worker(variant, broker, logdir, args)
    try:
        time.sleep(3.0)  # the worker up (the plugin's also elects a scheduler)
        seq = _publish_all(mod, 0, 8)
        _wait(client, 8, 120)
        client.delete(RESULTS_KEY)
        t0 = time.time()
        seq = _publish_all(mod, seq, args.burst)
        burst = _wait(client, args.burst, 600)
        client.delete(RESULTS_KEY)
        sent = _publish_at(mod, seq, args.rate, args.steady_s)
        steady = _wait(client, sent, 300)
        client.delete(RESULTS_KEY)
        single = _one_at_a_time(mod, client, seq + sent, args.sequential)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        mod.app.close()
    return _summary(burst, t0, steady, single)


def _summary(
    burst: list[dict[str, Any]], t0: float, steady: list[dict[str, Any]], single: list[float]
) -> dict[str, Any]:
    return {
        "throughput": len(burst) / (max(r["end"] for r in burst) - t0),
        "mean_batch": len(burst) / len({(r["pid"], r["end"]) for r in burst}),
        "burst_p50_ms": _pct(_latencies(burst), 0.5),
        "steady_p50_ms": _pct(_latencies(steady), 0.5),
        "steady_p99_ms": _pct(_latencies(steady), 0.99),
        "single_p50_ms": _pct(sorted(single), 0.5),
        "processes": len({r["pid"] for r in burst + steady}),
    }


def _latencies(rows: list[dict[str, Any]]) -> list[float]:
    return sorted(1000 * (r["end"] - r["published"]) for r in rows)


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def _publish_all(mod: Any, first: int, n: int) -> int:
    for i in range(first, first + n):
        mod.app.tasks["bench.infer"].apply_async(args=[i, time.time()])
    return first + n


def _publish_at(mod: Any, first: int, rate: float, seconds: float) -> int:
    """Publish at `rate` per second for `seconds` (open loop); the number published."""
    task, start, n = mod.app.tasks["bench.infer"], time.monotonic(), 0
    while n < rate * seconds:
        due = start + n / rate
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        task.apply_async(args=[first + n, time.time()])
        n += 1
    return n


def _one_at_a_time(mod: Any, client: redis.Redis, first: int, n: int) -> list[float]:
    out = []
    for i in range(n):
        mod.app.tasks["bench.infer"].apply_async(args=[first + i, time.time()])
        out.extend(_latencies(_wait(client, 1, 60)))
        client.delete(RESULTS_KEY)
    return out


def _wait(client: redis.Redis, n: int, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while client.llen(RESULTS_KEY) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {client.llen(RESULTS_KEY)}/{n} requests finished")
        time.sleep(0.01)
    rows = []
    for raw in client.lrange(RESULTS_KEY, 0, -1):
        seq, published, end, pid, size = raw.decode().split()
        rows.append({"seq": int(seq), "published": float(published), "end": float(end),
                     "pid": int(pid), "n": int(size)})  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--burst", type=int, default=640)
    parser.add_argument("--rate", type=float, default=30.0, help="steady phase, requests/s")
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--sequential", type=int, default=30)
    parser.add_argument("--base-ms", type=float, default=20.0)
    parser.add_argument("--per-item-ms", type=float, default=0.5)
    parser.add_argument("--max-size", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ojs-bench-batch-") as tmp:
        logdir = Path(tmp)
        with private_redis(logdir) as broker:
            for variant in args.variants.split(","):
                print(f"running {variant} ...", file=sys.stderr, flush=True)
                results[variant] = run_variant(variant, broker, args, logdir)
    base = results.get("baseline")
    for r in results.values():
        r["ratio"] = r["throughput"] / base["throughput"] if base else None
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _print(results, args)
    return 0


def _print(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"cost per call: {args.base_ms:g} ms + {args.per_item_ms:g} ms x n; "
          f"steady load {args.rate:g} requests/s")  # fmt: skip
    print(f"{'variant':14} {'req/s':>7} {'ratio':>6} {'batch':>6} {'burst p50':>10} "
          f"{'steady p50':>11} {'steady p99':>11} {'1-by-1 p50':>11}")  # fmt: skip
    for name, r in results.items():
        ratio = f"{r['ratio']:6.2f}" if r["ratio"] is not None else "     -"
        print(f"{name:14} {r['throughput']:7.1f} {ratio} {r['mean_batch']:6.1f} "
              f"{r['burst_p50_ms']:10.1f} {r['steady_p50_ms']:11.1f} {r['steady_p99_ms']:11.1f} "
              f"{r['single_p50_ms']:11.1f}")  # fmt: skip
    batch = results.get("plugin-batch")
    if batch and batch["ratio"] is not None:
        verdict = "PASS" if batch["ratio"] >= TARGET else "MISS"
        print(f"target plugin-batch throughput >= {TARGET:g}x baseline: {verdict}")


if __name__ == "__main__":
    raise SystemExit(main())
