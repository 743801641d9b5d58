"""Two workers on one host, started with disjoint CUDA_VISIBLE_DEVICES, never share a
device: each pins its tasks to its own devices, and CUDA_DEVICE_ORDER is set."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def test_two_workers_with_disjoint_visible_devices_never_share_a_device(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    workers = [
        WorkerProcess(name, redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2,
                      extra_env={"CUDA_VISIBLE_DEVICES": cvd, "OJS_TEST_RECYCLE": "warm"})
        for name, cvd in (("a", "0,1"), ("b", "2,3"))
    ]  # fmt: skip
    with running(workers, OJSStore(redis_client, prefix="ojs")):
        for i in range(16):
            app.tasks["ml.record"].apply_async(args=[f"v{i}", 0.1])
        deadline = time.monotonic() + 60
        while redis_client.llen(RESULTS_KEY) < 16 and time.monotonic() < deadline:
            time.sleep(0.05)
    runs = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert len(runs) == 16
    used = {w: {r["cvd"] for r in runs if r["worker"] == w} for w in ("a@test", "b@test")}
    assert used["a@test"] <= {"0", "1"} and used["b@test"] <= {"2", "3"}, used
    assert used["a@test"] and used["b@test"], "both workers ran tasks"
    assert all(r["first_cvd"] == r["cvd"] for r in runs)  # warm children stay on their device
    app.close()
