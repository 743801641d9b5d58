"""Pools other than prefork (DESIGN decision 3): pinning is refused, never faked.

The threads pool shares one process, so CUDA_VISIBLE_DEVICES cannot differ per
task. The worker says so at start, still allocates devices (capacity safety
holds) and hands them to the task in `self.request.ojs_devices`; with
`ojs_ml_require_pinning=True` it refuses to start instead.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.settings import read_settings
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def test_a_threads_pool_gpu_worker_refuses_pinning_but_still_allocates(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    worker = WorkerProcess("t", redis_url, "profile:nvidia-a100x2", tmp_path, pool="threads")
    with running([worker], store):
        for i in range(4):
            app.tasks["ml.record"].apply_async(args=[f"t{i}", 0.3])
        deadline = time.monotonic() + 30
        while redis_client.llen(RESULTS_KEY) < 4:
            assert time.monotonic() < deadline, worker.output()[-3000:]
            time.sleep(0.05)
    records = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert all(r["cvd"] is None for r in records), "threads pool must not set CUDA_VISIBLE_DEVICES"
    assert all(len(r["devices"]) == 1 for r in records)
    for r in records:
        for o in records:
            if o is not r and r["start"] < o["end"] and o["start"] < r["end"]:
                assert r["devices"] != o["devices"], (r, o)
    assert "cannot pin GPUs per task" in worker.output()
    app.close()


def test_require_pinning_stops_a_non_prefork_gpu_worker_with_the_reason(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    worker = WorkerProcess(
        "s", redis_url, "profile:nvidia-l4x1", tmp_path, pool="solo",
        extra_env={"OJS_TEST_REQUIRE_PINNING": "1"},
    )  # fmt: skip
    worker.start()
    assert worker.proc is not None
    worker.proc.wait(timeout=60)
    assert worker.proc.returncode != 0
    assert "ojs_ml_require_pinning is True" in worker.output()
    assert "--pool prefork" in worker.output()


def test_a_bad_setting_fails_at_start_with_the_valid_values() -> None:
    with pytest.raises(ConfigError, match="ojs_ml_max_hold_s"):
        read_settings({"ojs_ml_max_hold": 3})
    with pytest.raises(ConfigError, match="max_hold_s"):
        read_settings({"ojs_ml_max_hold_s": -1})


def test_a_gpu_worker_with_fewer_processes_than_gpus_says_so_at_start(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Jobs beyond the pool size would hold GPUs while they wait for a process."""
    store = OJSStore(redis_client, prefix="ojs")
    few = WorkerProcess("few", redis_url, "profile:nvidia-a100x8", tmp_path, concurrency=2)
    enough = WorkerProcess("enough", redis_url, "profile:nvidia-l4x1", tmp_path, concurrency=1)
    with running([few, enough], store):
        pass
    assert "this worker has 8 GPUs but 2 pool processes" in few.output()
    assert "Start it with -c 8" in few.output()
    assert "pool processes" not in enough.output()
