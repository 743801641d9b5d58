"""The fleet scheduler counts pool processes (`FreeCapacity.processes`) with real workers.

A worker advertises its pool's processes (`info.processes`, Celery 5.7's
`BasePool.num_processes`: this file fails if that changes) and the leader takes the
jobs it runs or was assigned off them. A worker with free GPUs but every process busy
is passed over for one with a free process; before, best fit sent the job there and it
waited in the pool's queue, holding a GPU, while the other worker was idle. Plain
Celery tasks running in the pool are counted too (`info.plain_running`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)
    return found


def test_a_job_goes_to_a_worker_with_a_free_process_not_to_a_busy_one_with_free_gpus(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """`one` (2 GPUs, `-c 1`) runs `long` (best fit: it leaves `one` with 1 GPU free).
    `next` (1 GPU) fits `one`'s free GPU best, but `one`'s only process is busy: it
    starts at once on `four` (4 GPUs, `-c 4`) instead of waiting for `long` to end."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    workers = [
        WorkerProcess("one", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=1),
        WorkerProcess("four", redis_url, "profile:nvidia-a100x4", tmp_path, concurrency=4),
    ]
    with running(workers, store):
        live = _wait(lambda: _both(store), 20, "both workers' heartbeats")
        assert live["one@test"]["info"]["processes"] == 1, live["one@test"]["info"]
        assert live["four@test"]["info"]["processes"] == 4, live["four@test"]["info"]
        long = record.apply_async(args=["long", 5.0], headers={"ext_ml_gpu_count": 1})
        _wait(lambda: _on_devices(store, long.id), 20, "long to start")
        sent = time.time()
        nxt = record.apply_async(args=["next", 0.1], headers={"ext_ml_gpu_count": 1})
        _wait(lambda: redis_client.llen(RESULTS_KEY) >= 2, 20, "both jobs")
    _started_beside(redis_client, long.id, nxt.id, sent)
    app.close()


def test_a_plain_celery_task_running_in_a_pool_keeps_ml_jobs_off_its_process(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """`one` (1 GPU, `-c 1`) runs a long plain Celery task from a queue only it consumes;
    its heartbeat reports it (`info.plain_running`, from Celery 5.7's
    `worker.state.active_requests`: this fails if that changes). `next` (1 GPU) fits
    `one`'s free GPU best, but its only process is busy: it starts at once on `four`
    (4 GPUs, `-c 4`). Before, only ML jobs were counted and `next` waited for the
    plain task in `one`'s pool queue."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    workers = [
        WorkerProcess(
            "one", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=1, queue="celery,slow"
        ),
        WorkerProcess("four", redis_url, "profile:nvidia-a100x4", tmp_path, concurrency=4),
    ]
    with running(workers, store):
        _wait(lambda: _both(store), 20, "both workers' heartbeats")
        plain = app.tasks["plain.sleep"].apply_async(args=["plain", 8.0], queue="slow")
        _wait(lambda: _plain_running(store, "one@test") == 1, 15, "one's plain task reported")
        assert _plain_running(store, "four@test") == 0
        sent = time.time()
        nxt = app.tasks["ml.record"].apply_async(args=["next", 0.1])
        _wait(lambda: redis_client.llen(RESULTS_KEY) >= 2, 30, "both tasks")
    _started_beside(redis_client, plain.id, nxt.id, sent)
    app.close()


def _started_beside(client: redis.Redis, busy: str, nxt: str, sent: float) -> None:
    """`busy` ran on `one` and `nxt` (published at `sent`) started at once on `four`,
    before `busy` ended; each ran exactly once."""
    runs = {r["task_id"]: r for r in map(json.loads, client.lrange(RESULTS_KEY, 0, -1))}
    assert sorted(runs) == sorted([busy, nxt]), "a task was lost or ran twice"
    assert runs[busy]["worker"] == "one@test", runs[busy]
    assert runs[nxt]["worker"] == "four@test", runs[nxt]
    assert runs[nxt]["start"] < runs[busy]["end"], "next waited for the busy process"
    assert runs[nxt]["start"] - sent < 2.0, runs[nxt]


def _plain_running(store: OJSStore, worker: str) -> Any:
    return (store.live_workers().get(worker) or {}).get("info", {}).get("plain_running")


def _both(store: OJSStore) -> dict[str, Any] | None:
    live = store.live_workers()
    return live if {"one@test", "four@test"} <= set(live) else None


def _on_devices(store: OJSStore, task_id: str) -> bool:
    for view in store.live_workers().values():
        if task_id in (view.get("free", {}).get("devices") or {}).values():
            return True
    return False


def test_a_heartbeat_that_reports_a_change_in_plain_tasks_wakes_the_scheduler(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """No release reports a plain task, and a leader deciding an arrival on the fleet its
    last quiet pass read (the fast lane) would not see the heartbeat that does: `next`
    went to `one`'s busy process (seen in CI). The heartbeat that carries a change
    pushes a wake-up on the intake, which ends the lane. `one` leads nothing here
    (`ojs_ml_scheduler="off"`), so its wake-ups stay on the intake to be counted."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    conf = json.dumps({"ojs_ml_scheduler": "off"})
    one = WorkerProcess(
        "one", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=1,
        queue="celery,slow", extra_env={"OJS_TEST_CONF": conf},
    )  # fmt: skip

    def wakes() -> int:
        found = redis_client.lrange("ojs.ml.intake", 0, -1)
        return sum(b'"ojs_wake": "one@test"' in m for m in found)

    with running([one], store):
        _wait(lambda: _plain_running(store, "one@test") == 0, 20, "one's heartbeat")
        joined = wakes()  # a worker joining wakes the scheduler
        assert joined >= 1
        app.tasks["plain.sleep"].apply_async(args=["plain", 4.0], queue="slow")
        _wait(lambda: _plain_running(store, "one@test") == 1, 15, "one's plain task reported")
        assert wakes() == joined + 1, "the heartbeat that reported the plain task woke no one"
        _wait(lambda: _plain_running(store, "one@test") == 0, 15, "the plain task's end reported")
        assert wakes() == joined + 2
    app.close()
