"""Dynamic batching (`ml_batch`) on real prefork workers with simulated CUDA
(docs/serving.md, "Dynamic batching").

Each call of the batched task records its requests' ids, the devices the gate
pinned and the CUDA_VISIBLE_DEVICES its process saw; the tests check the batch
contract from outside: several requests per call, at most `max_size`, one
device set per call, every request run exactly once with its own result under
its own id.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.batchapp import FAIL, MAX_SIZE, RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration
APP = "tests.integration.batchapp:app"
WARM = {"OJS_TEST_RECYCLE": "warm"}


def _calls(client: redis.Redis, requests: int, timeout: float = 90.0) -> list[dict[str, Any]]:
    """The recorded calls, once they have run `requests` requests in all."""
    deadline = time.monotonic() + timeout
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        found = [json.loads(raw) for raw in client.lrange(RESULTS_KEY, 0, -1)]
        if sum(len(c["ids"]) for c in found) >= requests:
            break
        time.sleep(0.05)
    ran = sum(len(c["ids"]) for c in found)
    assert ran == requests, f"{ran}/{requests} requests ran in {len(found)} calls"
    return found


def _warm_up(app: Celery) -> None:
    """One request first: the worker's child binds to its device and the class's jobs
    flow (the scheduler grants the class to the worker once nothing waits)."""
    app.tasks["ml.batch_double"].apply_async(args=[0]).get(timeout=60)


def _one_device_set_per_call(calls: list[dict[str, Any]]) -> None:
    for call in calls:
        assert len(call["devices"]) == 1, call
        assert call["cvd"] == str(call["devices"][0]), call
        assert call["first_cvd"] == call["cvd"], f"CUDA bound to {call['first_cvd']}: {call}"


def test_a_batched_task_receives_several_requests_in_one_call_each_with_its_own_result(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2,
                           app=APP, extra_env=WARM)  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        _warm_up(app)
        jobs = [
            app.tasks["ml.batch_double"].apply_async(args=[i], kwargs={"sleep_s": 0.2})
            for i in range(1, 21)
        ]
        results = {job.id: job.get(timeout=90) for job in jobs}
        calls = _calls(redis_client, 21)
    assert results == {job.id: {"x": i, "y": 2 * i} for i, job in enumerate(jobs, start=1)}
    sizes = [len(c["ids"]) for c in calls]
    assert max(sizes) > 1, f"no call received more than one request: {sizes}"
    assert max(sizes) <= MAX_SIZE, sizes
    ran = Counter(i for c in calls for i in c["ids"])
    assert set(ran) == {j.id for j in jobs} | {calls[0]["ids"][0]}
    assert set(ran.values()) == {1}, "a request ran twice"
    assert all(c["ids"][0] == c["first_id"] for c in calls)
    _one_device_set_per_call(calls)
    spans = sorted((c["start"], c["end"]) for c in calls)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), (
        "two calls ran at once on a worker with one GPU"
    )
    app.close()


def test_an_exception_returned_for_one_request_fails_that_request_alone(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=1,
                           app=APP, extra_env=WARM)  # fmt: skip
    task = app.tasks["ml.batch_double"]
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        _warm_up(app)
        blocker = task.apply_async(args=[100], kwargs={"sleep_s": 1.0})
        time.sleep(0.3)  # the next ones wait at the gate behind it, then go as one batch
        jobs = [task.apply_async(args=[x]) for x in (1, FAIL, 3)]
        blocker.get(timeout=60)
        for job in (jobs[0], jobs[2]):
            job.get(timeout=60)
        with pytest.raises(ValueError, match="asked to fail"):
            jobs[1].get(timeout=60)
        calls = _calls(redis_client, 5)
    assert [j.state for j in jobs] == ["SUCCESS", "FAILURE", "SUCCESS"]
    assert (jobs[0].result, jobs[2].result) == ({"x": 1, "y": 2}, {"x": 3, "y": 6})
    together = next(c for c in calls if jobs[1].id in c["ids"])
    assert len(together["ids"]) > 1, f"the failing request ran alone: {calls}"
    app.close()


def test_a_batch_is_never_split_across_devices_on_a_two_gpu_worker(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2,
                           app=APP, extra_env=WARM)  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        _warm_up(app)
        jobs = [
            app.tasks["ml.batch_double"].apply_async(args=[i], kwargs={"sleep_s": 0.2})
            for i in range(1, 31)
        ]
        for job in jobs:
            job.get(timeout=90)
        calls = _calls(redis_client, 31)
    _one_device_set_per_call(calls)
    assert max(len(c["ids"]) for c in calls) > 1
    ran = Counter(i for c in calls for i in c["ids"])
    assert set(ran.values()) == {1}, "a request ran twice"
    for a in calls:  # calls that overlap in time ran on different devices
        for b in calls:
            if a is not b and a["start"] < b["end"] and b["start"] < a["end"]:
                assert a["devices"] != b["devices"], (a, b)
    app.close()


def _records(client: redis.Redis, tag: str) -> list[dict[str, Any]]:
    found = [json.loads(raw) for raw in client.lrange(RESULTS_KEY, 0, -1)]
    return [r for r in found if r.get("tag") == tag]


def _until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_preempted_batch_re_publishes_every_request_as_a_preempted_job(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """OJS ML §8: a reserved job preempts a spot batch (policy `immediate`, so the batch's
    child is killed at once); each request of the batch runs again once, counted as one
    preemption, and ends with its own result."""
    spot = {"ext_ml_priority_class": "spot", "ext_mlx_scheduling_preemption_policy": "immediate"}
    app = make_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2,
                           app=APP, extra_env={**WARM, "OJS_TEST_MIN_RUNTIME": "0"})  # fmt: skip
    slow = app.tasks["ml.batch_slow"]
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        slow.apply_async(args=[0], headers=spot).get(timeout=60)  # the class's jobs flow
        slow.apply_async(args=[-1], kwargs={"sleep_s": 1.0}, headers=spot)  # holds the GPU
        _until(lambda: len(_records(redis_client, "slow-start")) == 2, 30, "the first call")
        jobs = [slow.apply_async(args=[i], kwargs={"sleep_s": 60}, headers=spot) for i in (1, 2, 3)]
        ids = {j.id for j in jobs}  # they wait at the gate, then start as one batch

        def batched() -> bool:
            return any(len(set(r["ids"]) & ids) > 1 for r in _records(redis_client, "slow-start"))

        _until(batched, 30, "a batch of the spot requests to start")
        reserved = {"ext_ml_priority_class": "reserved"}
        app.tasks["ml.record"].apply_async(args=["reserved", 0.1], headers=reserved).get(timeout=60)
        assert sorted(j.get(timeout=60) for j in jobs) == [1, 2, 3]
        starts = _records(redis_client, "slow-start")
        ends = _records(redis_client, "slow-end")
    preempted = next(r for r in starts if len(set(r["ids"]) & ids) > 1)
    assert preempted["preemptions"] == [0] * len(preempted["ids"])
    again = {
        i: p
        for r in starts[starts.index(preempted) + 1 :]
        for i, p in zip(r["ids"], r["preemptions"], strict=True)
    }
    assert {i: again.get(i) for i in preempted["ids"]} == {i: 1 for i in preempted["ids"]}, (
        "each request of the preempted batch runs again as its first preemption"
    )
    finished = Counter(i for r in ends for i in r["ids"])
    assert all(finished[i] == 1 for i in ids), finished
    app.close()
