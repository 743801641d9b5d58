"""Pipelining (`ojs_ml_pipeline`, `worker.pipelining`) on real prefork workers with warm
children and simulated CUDA: a job held at the gate is written to the warm child of the
running job with the same needs, behind it, and takes its devices as it ends.

What must hold, per job: it ran once; no two jobs ever ran on one device at once; the
device set its process's CUDA was born with equals its allocation."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration
WARM = {"OJS_TEST_RECYCLE": "warm"}


def _results(client: redis.Redis, count: int, timeout: float = 90.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while client.llen(RESULTS_KEY) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # nothing runs twice afterwards
    return [json.loads(raw) for raw in client.lrange(RESULTS_KEY, 0, -1)]


def _warm_stats(app: Any, host: str) -> str:
    stats = app.control.inspect(timeout=2.0, destination=[host]).stats() or {}
    return str(stats.get(host, {}).get("ojs_ml.warm", ""))


def _no_device_runs_two_jobs(records: list[dict[str, Any]]) -> None:
    by_device: dict[tuple[str, int], list[tuple[float, float, str]]] = defaultdict(list)
    for r in records:
        for device in r["devices"]:
            by_device[(r["worker"], device)].append((r["start"], r["end"], r["task_id"]))
    for device, spans in by_device.items():
        spans.sort()
        for (_, end, first), (start, _, second) in pairwise(spans):
            assert start >= end, f"{first} and {second} overlapped on {device}"


def _born_where_pinned(records: list[dict[str, Any]]) -> None:
    for r in records:
        assert r["cvd"] == ",".join(map(str, r["devices"])), r
        assert r["first_cvd"] == r["cvd"], f"CUDA bound to {r['first_cvd']}, task got {r}"


@pytest.mark.parametrize(
    ("profile", "processes", "prefetch"),
    [("nvidia-a100x2", 2, 2), ("nvidia-a100x1", 1, 4)],
    ids=["2 GPUs, 2 sent ahead", "1 GPU, -c 1, 4 sent ahead"],
)
def test_held_jobs_follow_the_running_job_in_its_child_each_once_never_two_on_a_device(
    redis_url: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    profile: str,
    processes: int,
    prefetch: int,
) -> None:
    """A backlog of 1-GPU jobs: those the scheduler sends ahead wait at the gate and are
    written behind a running job of the same needs (docs/serving.md, "Pipelining")."""
    app = make_app(redis_url)
    conf = json.dumps({"ojs_ml_prefetch": prefetch, "ojs_ml_pipeline": True})
    worker = WorkerProcess("a", redis_url, f"profile:{profile}", tmp_path,
                           concurrency=processes,
                           extra_env={**WARM, "OJS_TEST_CONF": conf})  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        ids = [app.tasks["ml.record"].apply_async(args=[f"p{i}", 0.05]).id for i in range(40)]
        records = _results(redis_client, 40)
        warm = _warm_stats(app, "a@test")
    assert sorted(r["task_id"] for r in records) == sorted(ids), "a job was lost or ran twice"
    _no_device_runs_two_jobs(records)
    _born_where_pinned(records)
    assert "pipelined" in warm, f"no job was written behind a running one: {warm!r}"
    app.close()


def test_with_pipelining_off_no_job_is_written_behind_another(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    conf = json.dumps({"ojs_ml_prefetch": 2, "ojs_ml_pipeline": False})
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=1,
                           extra_env={**WARM, "OJS_TEST_CONF": conf})  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        ids = [app.tasks["ml.record"].apply_async(args=[f"o{i}", 0.05]).id for i in range(12)]
        records = _results(redis_client, 12)
        warm = _warm_stats(app, "a@test")
    assert sorted(r["task_id"] for r in records) == sorted(ids)
    _no_device_runs_two_jobs(records)
    assert warm and "pipelined" not in warm, warm
    app.close()


def test_a_job_queued_behind_one_whose_child_is_killed_runs_once_in_a_fresh_child(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The pool child running the lead is SIGKILLed while the follower waits in its pipe:
    billiard puts the unread follower back, the lead's end hands it the device, and it
    runs once, in a fresh child whose CUDA is born on that device."""
    app = make_app(redis_url)
    conf = json.dumps({"ojs_ml_prefetch": 2, "ojs_ml_scheduler": "thread", "ojs_ml_max_hold_s": 30})
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=1,
                           extra_env={**WARM, "OJS_TEST_CONF": conf})  # fmt: skip
    record = app.tasks["ml.record"]
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        assert worker.proc is not None
        record.apply_async(args=["warm-up", 0.0])
        _results(redis_client, 1, timeout=30)
        redis_client.delete(RESULTS_KEY)
        record.apply_async(args=["lead", 8.0], time_limit=10)  # it ends soon: send ahead
        time.sleep(1.0)  # the lead runs
        follower = record.apply_async(args=["follower", 0.0]).id
        deadline = time.monotonic() + 20
        while "pipelined" not in _warm_stats(app, "a@test") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "pipelined" in _warm_stats(app, "a@test"), "the follower was not written behind"
        children = psutil.Process(worker.proc.pid).children()
        assert len(children) == 1, children  # the scheduler runs as a thread here
        children[0].kill()
        records = [r for r in _results(redis_client, 1, timeout=40) if r["tag"] == "follower"]
    assert [r["task_id"] for r in records] == [follower], "the follower was lost or ran twice"
    assert records[0]["pid"] != children[0].pid
    _born_where_pinned(records)
    app.close()
