"""Warm GPU children (`ojs_ml_recycle_gpu_children = "warm"`) on real prefork
workers with simulated CUDA (the fake `libcuda.so` of tests/integration/mlapp.py).

The invariant, for every task: the device set its process's CUDA was
initialised with (`first_cvd`, the CUDA_VISIBLE_DEVICES at the process's first
GPU use) equals the task's allocation (`cvd`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration
WARM = {"OJS_TEST_RECYCLE": "warm"}


def _results(client: redis.Redis, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while client.llen(RESULTS_KEY) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    found = [json.loads(raw) for raw in client.lrange(RESULTS_KEY, 0, -1)]
    assert len(found) == count, f"{len(found)}/{count} tasks recorded a result"
    return found


def _invariant_holds(records: list[dict[str, Any]]) -> None:
    for r in records:
        if r["cuda"]:
            assert r["cvd"] == ",".join(map(str, r["devices"])), r
            assert r["first_cvd"] == r["cvd"], f"CUDA bound to {r['first_cvd']}, task got {r}"


def test_a_child_serves_many_gpu_tasks_on_its_device_set_without_reinitialising(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x4", tmp_path, concurrency=4,
                           extra_env=WARM)  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        for i in range(40):
            app.tasks["ml.record"].apply_async(args=[f"r{i}", 0.05])
        records = _results(redis_client, 40)
    _invariant_holds(records)
    per_pid = Counter(r["pid"] for r in records)
    assert len(per_pid) <= 5, f"children were not kept warm: {per_pid}"
    assert max(per_pid.values()) >= 8, per_pid
    app.close()


def test_the_invariant_holds_over_a_mixed_batch_of_1_2_and_4_gpu_jobs(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Mixed sizes force retirements: a child bound to one set never runs another."""
    app = make_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x4", tmp_path, concurrency=3,
                           extra_env=WARM)  # fmt: skip
    sizes = [1, 2, 1, 4, 1, 1, 2, 2, 1, 4, 1, 2, 1, 1, 4, 2, 1, 1]
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        for i, n in enumerate(sizes):
            app.tasks["ml.record"].apply_async(
                args=[f"m{i}", 0.1], kwargs={"cuda": i % 5 != 4},
                headers={"ext_ml_gpu_count": n},
            )  # fmt: skip
        records = _results(redis_client, len(sizes))
    _invariant_holds(records)
    assert sorted(len(r["devices"]) for r in records) == sorted(sizes)
    by_pid: dict[int, set[str]] = {}
    for r in records:
        if r["cuda"]:
            by_pid.setdefault(r["pid"], set()).add(r["cvd"])
    assert all(len(sets) == 1 for sets in by_pid.values()), by_pid
    assert any(sum(1 for r in records if r["pid"] == pid) > 1 for pid in by_pid), (
        "no child was reused"
    )
    app.close()


def test_a_worker_with_fewer_processes_than_gpus_keeps_its_children_warm(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Two children, four GPUs: the gate picks the devices an idle child is bound to."""
    app = make_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x4", tmp_path, concurrency=2,
                           extra_env=WARM)  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        for i in range(20):
            app.tasks["ml.record"].apply_async(args=[f"f{i}", 0.05])
        records = _results(redis_client, 20)
    _invariant_holds(records)
    assert len({r["pid"] for r in records}) <= 3, "children retired without need"
    app.close()
