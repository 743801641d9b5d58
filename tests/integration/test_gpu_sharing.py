"""GPU sharing by VRAM with a real worker (docs/sharing.md): many share jobs run at once on
one device, the shares on a device never pass 1000 milli-GPU, a whole-GPU job never runs on
a device a share is on, and a share task sees only its device and its share."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

_SHARING = {"OJS_TEST_CONF": json.dumps({"ojs_ml_gpu_sharing": "vram"}), "OJS_TEST_RECYCLE": "warm"}


def _wait_for(client: redis.Redis, count: int, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while client.llen(RESULTS_KEY) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return [json.loads(r) for r in client.lrange(RESULTS_KEY, 0, -1)]


def _peak_milli(runs: list[dict[str, Any]], device: int) -> int:
    """The largest sum of share milli-GPU on `device` at any instant (a sweep over starts)."""
    shares = [r for r in runs if r.get("share") and r["devices"] == [device]]
    return max(
        (sum(s["share"]["milli"] for s in shares if s["start"] <= r["start"] < s["end"])
         for r in shares),
        default=0,
    )  # fmt: skip


def test_share_jobs_run_together_within_1000_milli_and_apart_from_whole_jobs(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    worker = WorkerProcess(
        "share", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=6, extra_env=_SHARING
    )
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        for i in range(8):  # 30 GB of 80: 375 milli, two per device
            app.tasks["ml.share"].apply_async(args=[f"vram{i}", 1.0])
        for i in range(4):  # a fifth of a GPU: 200 milli, fits beside two VRAM shares
            app.tasks["ml.share"].apply_async(
                args=[f"frac{i}", 1.0], headers={"ojs_ml_gpu_share": 0.2}
            )
        for i in range(3):
            app.tasks["ml.record"].apply_async(args=[f"whole{i}", 0.5, False])
        runs = _wait_for(redis_client, 15, 90)
    assert len(runs) == 15, worker.output()[-3000:]
    shares = [r for r in runs if r["tag"].startswith(("vram", "frac"))]
    wholes = [r for r in runs if r["tag"].startswith("whole")]
    for device in (0, 1):
        assert _peak_milli(runs, device) <= 1000
    overlapping = [
        (w["tag"], s["tag"])
        for w in wholes
        for s in shares
        if s["devices"] == w["devices"] and s["start"] < w["end"] and w["start"] < s["end"]
    ]
    assert overlapping == [], "a whole-GPU job ran on a device a share was on"
    concurrent = max(sum(1 for s in shares if s["start"] <= r["start"] < s["end"]) for r in shares)
    assert concurrent >= 3, "share jobs ran together on the worker"
    for r in shares:
        assert r["cvd"] == str(r["devices"][0]) and len(r["devices"]) == 1
        assert r["share"]["device"] == r["devices"][0]
    vram = next(r for r in shares if r["tag"].startswith("vram"))
    assert vram["share"] == {"device": vram["devices"][0], "milli": 375, "memory_gb": 30.0}
    frac = next(r for r in shares if r["tag"].startswith("frac"))
    assert frac["share"]["milli"] == 200 and frac["share"]["memory_gb"] == 16.0
    app.close()


def test_a_worker_without_sharing_never_runs_a_share_job(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    worker = WorkerProcess("whole", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2)
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        app.tasks["ml.share"].apply_async(args=["never", 0.0])
        app.tasks["ml.record"].apply_async(args=["whole", 0.0, False])
        runs = _wait_for(redis_client, 1, 30)
        time.sleep(2.0)
        runs = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert [r["tag"] for r in runs] == ["whole"]
    app.close()
