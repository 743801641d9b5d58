"""Inference benchmark: warm children vs retirement vs one worker per GPU.

A GPU inference task (`bench/inference_app.py`: simulated CUDA init 0.3 s and
model load 1 s per process, 20 ms of compute per request), 1-GPU requests, on:

1. `plugin-warm`: the plugin with its defaults, one 4-GPU (simulated) worker,
   `-c 4`: warm children (`ojs_ml_recycle_gpu_children="warm"`) and
   `ojs_ml_prefetch = 2` (the next jobs wait at the worker's gate and start the
   moment a job ends);
2. `plugin-prefetch`: plugin-warm with `ojs_ml_prefetch = 4`;
   `plugin-serial`: the same with `ojs_ml_pipeline = False` (a held job is written
   to its child only once the running one's result is back);
3. `plugin-noprefetch`: plugin-warm with `ojs_ml_prefetch = 0` (every job waits
   for a scheduler pass after a GPU frees: the default before 2026-11-27);
4. `plugin-retire`: the defaults with `"cuda"` (a child that initialised CUDA is
   retired after its task: the behaviour before warm children);
5. `plugin-fair`: plugin-warm with fair-share weights (`ojs_ml_fair_share`
   `{"celery": 1, "batch": 3}`; the requests all go to `celery`): what a fleet
   that shares its GPUs between queues gets (prefetch was off with weights
   before 2026-11-27);
6. `baseline`: four plain Celery workers, each `CUDA_VISIBLE_DEVICES=i -c 1`,
   the model loaded in `worker_process_init` (the usual hand-made setup).

Each variant: a warm-up of 8 requests (not measured), then a burst of
`--burst` requests published back to back (throughput = requests / (last end
- first publish)), then `--sequential` requests one at a time (latency =
body end - publish, p50 and p90). Targets: plugin-warm throughput >= 0.9x the
baseline, and its p50 within 2 ms of the baseline's.

    .venv/bin/python bench/inference.py [--burst 120] [--sequential 40] [--json]

`--real --gpus N` runs the same on a machine with N real GPUs (PyTorch, see
`bench/inference_app.py`): the plugin probes them through NVML, the baseline
runs N workers; each variant also reports `mismatches`, the requests whose
process initialised CUDA with other devices than the task was pinned to, or
whose torch device UUID is not the pinned device's NVML UUID (must be 0).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
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

RESULTS_KEY = "ojs-bench:inference"
TRACE_KEY = "ojs-bench:received"
VARIANTS = (
    "plugin-warm",
    "plugin-prefetch",
    "plugin-serial",
    "plugin-noprefetch",
    "plugin-retire",
    "plugin-fair",
    "baseline",
)
_FAIR_SHARE = '{"celery": 1, "batch": 3}'
"""`ojs_ml_fair_share` of `plugin-fair`."""
_PREFETCH = {"plugin-prefetch": "4", "plugin-serial": "4", "plugin-noprefetch": "0"}
"""`ojs_ml_prefetch` of the variants that do not run with the plugin's default."""


def workers_for(
    variant: str,
    broker: str,
    logdir: Path,
    gpus: int = 4,
    real: bool = False,
    body: dict[str, str] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start the variant's workers (they log to `logdir`); `body`: the request body's
    environment (`calibrated`)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    base = {**os.environ, "OJS_BENCH_BROKER": broker, "PYTHONPATH": path,
            "OJS_BENCH_REAL": "1" if real else "0", **(body or {})}  # fmt: skip
    cmd = [sys.executable, "-m", "celery", "-A", "bench.inference_app", "worker", "-P",
           "prefork", "-l", "WARNING", "--without-gossip", "--without-mingle"]  # fmt: skip
    procs = []
    if variant == "baseline":
        for i in range(gpus):
            env = {**base, "OJS_BENCH_PLUGIN": "0", "OJS_BENCH_PRELOAD": "1",
                   "CUDA_VISIBLE_DEVICES": str(i)}  # fmt: skip
            procs.append(_start([*cmd, "-c", "1", "-n", f"gpu{i}@bench"], env, logdir / f"{i}.log"))
    else:
        recycle = "cuda" if variant == "plugin-retire" else "warm"
        prefetch = _PREFETCH.get(variant, "")  # "": the plugin's default
        env = {**base, "OJS_BENCH_PLUGIN": "1", "OJS_BENCH_RECYCLE": recycle,
               "OJS_BENCH_PIPELINE": "0" if variant == "plugin-serial" else "1",
               "OJS_BENCH_PREFETCH": prefetch,
               "OJS_BENCH_FAIR_SHARE": _FAIR_SHARE if variant == "plugin-fair" else ""}  # fmt: skip
        argv = [*cmd, "-c", str(gpus), "-n", "gpu@bench"]
        if not real:  # simulated GPUs; real ones are probed through NVML
            argv += ["--ojs-ml-capabilities", f"profile:nvidia-a100x{gpus}"]
        procs.append(_start(argv, env, logdir / f"{variant}.log"))
    return procs


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return proc


def run_variant(
    variant: str, broker: str, args: argparse.Namespace, logdir: Path
) -> dict[str, Any]:
    os.environ["OJS_BENCH_BROKER"] = broker
    os.environ["OJS_BENCH_PLUGIN"] = "0" if variant == "baseline" else "1"
    import importlib

    import bench.inference_app as mod

    mod = importlib.reload(mod)
    client = redis.Redis.from_url(broker)
    client.flushdb()
    procs = workers_for(variant, broker, logdir, args.gpus, args.real, calibrated(args))
    try:
        time.sleep(3.0)  # workers up (the plugin's also elect a scheduler)
        seq = _phase(mod, client, 0, 8, gap_s=None)  # warm-up: every process pays its cold start
        _wait(client, seq, 120)
        client.delete(RESULTS_KEY, TRACE_KEY)
        burst_start = time.time()
        seq2 = _phase(mod, client, seq, args.burst, gap_s=None)
        burst = _wait(client, seq2 - seq, 300)
        trace = received(client, burst) if args.trace else {}
        client.delete(RESULTS_KEY)
        lat = []
        for i in range(args.sequential):
            published = time.time()
            mod.infer.apply_async(args=[seq2 + i, published])
            lat.extend(_wait(client, 1, 60))
            client.delete(RESULTS_KEY)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        mod.app.close()
    ends = [r["end"] for r in burst]
    latencies = sorted(1000 * (r["end"] - r["published"]) for r in lat)
    return {
        "throughput": len(burst) / (max(ends) - burst_start),
        "first_start_ms": 1000 * (min(r["start"] for r in burst) - burst_start),
        "steady_throughput": _steady(burst),
        "cold_in_burst": sum(r["cold"] for r in burst),
        "p50_ms": statistics.median(latencies),
        "p90_ms": latencies[int(0.9 * (len(latencies) - 1))],
        "processes": len({r["pid"] for r in burst + lat}),
        "body_p50_ms": statistics.median(1000 * (r["end"] - r["start"]) for r in burst),
        "gap_p50_ms": statistics.median(gaps(burst)),
        "gap_p10_p90_ms": _p10_p90(gaps(burst)),
        **trace,
        **({"mismatches": mismatches(burst + lat)} if args.real else {}),
    }


def _steady(burst: list[dict[str, Any]]) -> float:
    """Requests/s from the first request's start to the last one's end (the burst's
    throughput without the wait for its first start)."""
    span = max(r["end"] for r in burst) - min(r["start"] for r in burst)
    return (len(burst) - 1) / span if span > 0 else 0.0


def _p10_p90(values: list[float]) -> list[float]:
    ordered = sorted(values)
    return [round(ordered[int(q * (len(ordered) - 1))], 2) for q in (0.1, 0.9)]


def gaps(burst: list[dict[str, Any]]) -> list[float]:
    """Per process of the burst: the next request's start - the previous one's end, ms
    (the hand-off between two requests; with one process per GPU, the GPU's idle time)."""
    out: list[float] = []
    for pid in {r["pid"] for r in burst}:
        mine = sorted((r for r in burst if r["pid"] == pid), key=lambda r: r["start"])
        out += [1000 * (b["start"] - a["end"]) for a, b in itertools.pairwise(mine)]
    return out or [0.0]


def received(client: redis.Redis, burst: list[dict[str, Any]]) -> dict[str, Any]:
    """`--trace`: how the burst's requests reached the worker (`kind`: see
    `inference_app._trace_received`) and, p50, when the worker's main process received
    each one after the previous request on its process ended (negative: in hand before)."""
    got: dict[int, tuple[float, str]] = {}
    for raw in client.lrange(TRACE_KEY, 0, -1):
        seq, when, how = (raw.decode() if isinstance(raw, bytes) else raw).split()
        got[int(seq)] = (float(when), how)
    kinds: dict[str, int] = {}
    late: list[float] = []
    for pid in {r["pid"] for r in burst}:
        mine = sorted((r for r in burst if r["pid"] == pid), key=lambda r: r["start"])
        for a, b in itertools.pairwise(mine):
            found = got.get(b["seq"])
            kind = "?" if found is None else found[1]
            kinds[kind] = kinds.get(kind, 0) + 1
            if found is not None:
                late.append(1000 * (found[0] - a["end"]))
    return {"received_after_end_p50_ms": statistics.median(late or [0.0]), "kinds": kinds}


def calibrated(args: argparse.Namespace) -> dict[str, str]:
    """The environment of the request body: the H200 calibration (`--calibrated`), or the
    default (20 ms of sleep, no result)."""
    trace = {"OJS_BENCH_TRACE": "1" if args.trace else "0"}
    if not args.calibrated:
        return {"OJS_BENCH_BODY": "", "OJS_BENCH_RESULT_BYTES": "0", **trace}
    return {"OJS_BENCH_BODY": "h200", "OJS_BENCH_RESULT_BYTES": str(args.result_bytes), **trace}


def mismatches(records: list[dict[str, Any]]) -> int:
    """Requests whose CUDA was initialised with other devices than the task's pinning,
    or whose torch UUID is not the NVML UUID of the pinned device (real mode)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        bad = 0
        for r in records:
            pinned = r["task_cvd"]
            if r["init_cvd"] != pinned or r["count"] != "1":
                bad += 1
                continue
            by_uuid = pinned.startswith(("GPU-", "MIG-"))
            get = pynvml.nvmlDeviceGetHandleByUUID if by_uuid else pynvml.nvmlDeviceGetHandleByIndex
            handle = get(pinned if by_uuid else int(pinned))
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            bad += uuid.removeprefix("GPU-") != r["uuid"].removeprefix("GPU-")
        return bad
    finally:
        pynvml.nvmlShutdown()


def _phase(mod: Any, client: redis.Redis, first: int, n: int, gap_s: float | None) -> int:
    for i in range(first, first + n):
        mod.infer.apply_async(args=[i, time.time()])
    return first + n


def _wait(client: redis.Redis, n: int, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while client.llen(RESULTS_KEY) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {client.llen(RESULTS_KEY)}/{n} requests finished")
        time.sleep(0.01)
    out: list[dict[str, Any]] = []
    for raw in client.lrange(RESULTS_KEY, 0, -1):
        seq, pub, start, end, pid, cold, *facts = raw.decode().split()
        row: dict[str, Any] = {"seq": int(seq), "published": float(pub), "start": float(start),
               "end": float(end), "pid": int(pid), "cold": int(cold)}  # fmt: skip
        if facts:  # real mode (bench/inference_app.py `real_facts`)
            row.update(zip(("init_cvd", "task_cvd", "uuid", "count"), facts, strict=True))
        out.append(row)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--burst", type=int, default=120)
    parser.add_argument("--sequential", type=int, default=40)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--logs", default="", help="keep the workers' logs in this folder")
    parser.add_argument("--real", action="store_true", help="real GPUs through PyTorch")
    parser.add_argument("--gpus", type=int, default=4, help="GPUs (simulated: 1, 2, 4 or 8)")
    parser.add_argument("--calibrated", action="store_true",
                        help="the H200 request body, 1 GPU (docs/performance.md)")  # fmt: skip
    parser.add_argument("--result-bytes", type=int, default=4096,
                        help="--calibrated: the size of each request's result")  # fmt: skip
    parser.add_argument("--trace", action="store_true",
                        help="when and how each request reached the worker (slower)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.calibrated:
        if args.real:
            parser.error("--calibrated simulates the H200 runs: drop --real")
        args.gpus = 1
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ojs-bench-infer-") as tmp:
        logdir = Path(args.logs or tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        with private_redis(logdir) as broker:
            for variant in args.variants.split(","):
                print(f"running {variant} ...", file=sys.stderr, flush=True)
                results[variant] = run_variant(variant, broker, args, logdir)
    base = results.get("baseline")
    if base:
        for r in results.values():
            r["throughput_ratio"] = r["throughput"] / base["throughput"]
            r["p50_added_ms"] = r["p50_ms"] - base["p50_ms"]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'variant':17} {'req/s':>8} {'ratio':>6} {'p50 ms':>8} {'+p50':>7} {'p90 ms':>8} "
          f"{'cold':>5} {'procs':>5} {'body ms':>8} {'gap ms':>7}")  # fmt: skip
    for name, r in results.items():
        print(f"{name:17} {r['throughput']:8.1f} {r.get('throughput_ratio', 0):6.2f} "
              f"{r['p50_ms']:8.1f} {r.get('p50_added_ms', 0):7.1f} {r['p90_ms']:8.1f} "
              f"{r['cold_in_burst']:5d} {r['processes']:5d} {r['body_p50_ms']:8.2f} "
              f"{r['gap_p50_ms']:7.2f}")  # fmt: skip
        if "kinds" in r:
            print(f"  received after the previous end, p50 {r['received_after_end_p50_ms']:.2f} ms;"
                  f" delivered as {r['kinds']}")  # fmt: skip
    if base and "plugin-warm" in results:
        w = results["plugin-warm"]
        ok_t, ok_l = w["throughput_ratio"] >= 0.9, w["p50_added_ms"] <= 2.0
        print(f"target throughput >= 0.9x baseline: {'PASS' if ok_t else 'MISS'}; "
              f"target p50 within 2 ms: {'PASS' if ok_l else 'MISS'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
