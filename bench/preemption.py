"""Preemption latency on a real prefork worker (OJS ML §8), for `bench/checkpoint.py`.

Two spot jobs (`ml.ckpt_train` from the integration test app, a checkpoint per
0.3 s epoch, `checkpoint_on_preempt`) fill both GPUs of a simulated A100x2
worker; then a reserved job that needs both GPUs is published. Reported per
trial, from the reserved job's publish:

* latency to the reserved job's first instruction (flag, victims checkpoint
  and yield, re-publish, allocation, hand-off to a pool child);
* the grace period (`ext_ml_preemption_grace_period_s`, 5 s here) bounds it from above:
  the victims here yield on the flag, so the figure is the cooperative path.

    .venv/bin/python bench/preemption.py [--trials 3] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dispatch import private_redis  # noqa: E402
from celery_ojs_ml.store.registry import OJSStore  # noqa: E402
from tests.integration.mlapp import RESULTS_KEY, make_app  # noqa: E402
from tests.integration.workers import WorkerProcess, running  # noqa: E402

GRACE_S = 5
SPOT = {"ext_ml_priority_class": "spot", "ext_ml_preemption_grace_period_s": GRACE_S}


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


def trial(url: str, client: redis.Redis, work: Path, n: int) -> float:
    """One preemption; returns seconds from the reserved publish to its start."""
    client.flushdb()
    ckpt = work / f"ckpt{n}"
    os.environ["OJS_TEST_CKPT"] = str(ckpt)
    store = OJSStore(client, prefix="ojs")
    app = make_app(url)
    worker = WorkerProcess(
        f"p{n}", url, "profile:nvidia-a100x2", work, concurrency=4,
        extra_env={"OJS_TEST_CKPT": str(ckpt)},
    )  # fmt: skip
    train = app.tasks["ml.ckpt_train"]
    try:
        with running([worker], store):
            ids = [train.apply_async(args=[40, 0.3], headers=SPOT).id for _ in range(2)]

            def both_running() -> bool:
                runs = [client.lrange(f"ojs-test:runs:{i}", -1, -1) for i in ids]
                return all(r and json.loads(r[0]).get("epoch", -1) >= 0 for r in runs)

            _wait(both_running, 30, "the spot jobs")
            sent = time.time()
            app.tasks["ml.record"].apply_async(
                args=["reserved", 0.1],
                headers={"ext_ml_priority_class": "reserved", "ext_ml_gpu_count": 2},
            )
            _wait(lambda: client.llen(RESULTS_KEY) >= 1, 3 * GRACE_S, "the reserved job")
            record = json.loads(client.lindex(RESULTS_KEY, 0) or b"{}")
            for task_id in ids:  # stop the resumed spot jobs quickly
                app.control.revoke(task_id)
    finally:
        app.close()
    return float(record["start"]) - sent


def measure(url: str, trials: int) -> list[float]:
    client = redis.Redis.from_url(url)
    with tempfile.TemporaryDirectory(prefix="ojs-preempt-bench-") as tmp:
        return [trial(url, client, Path(tmp), n) for n in range(trials)]


def report(latencies: list[float]) -> None:
    ms = sorted(x * 1000 for x in latencies)
    print(
        f"preemption latency (reserved publish -> reserved start, 2 spot victims that "
        f"checkpoint and yield, grace {GRACE_S} s), {len(ms)} trials: median "
        f"{statistics.median(ms):.0f} ms, min {ms[0]:.0f} ms, max {ms[-1]:.0f} ms"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    parser.add_argument("--trials", type=int, default=3, help="preemptions (default 3)")
    args = parser.parse_args(argv)
    if args.redis_url:
        report(measure(args.redis_url, args.trials))
        return
    with tempfile.TemporaryDirectory() as tmp, private_redis(Path(tmp)) as url:
        report(measure(url, args.trials))


if __name__ == "__main__":
    main()
