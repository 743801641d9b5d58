"""Inference dedup (OJS ML §14.6, opt-in `ml_dedup`) with a real worker: a duplicate inside
the window publishes nothing and returns the first job's result, atomically across
producers."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def _runs(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(RESULTS_KEY, 0, -1)]


def test_a_duplicate_inside_the_window_returns_the_first_jobs_result_and_publishes_nothing(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    other = make_app(redis_url)  # a second producer
    task, task2 = app.tasks["ml.dedup_echo"], other.tasks["ml.dedup_echo"]
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2)
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        found: list[Any] = []
        threads = [
            threading.Thread(target=lambda t=t: found.append(t.apply_async(args=[7])))
            for t in (task, task2, task, task2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({r.id for r in found}) == 1, "the producers did not agree on one job"
        assert [r.get(timeout=30)["y"] for r in found] == [70] * 4
        keyed = [task.apply_async(args=[i], ml_dedup_key="doc-1") for i in (1, 2)]
        assert keyed[0].id == keyed[1].id and keyed[1].get(timeout=30)["x"] == 1
        different = task.delay(8)
        assert different.id != found[0].id and different.get(timeout=30)["y"] == 80
        time.sleep(3.2)  # the window is 3 s
        later = task.delay(7)
        assert later.id != found[0].id and later.get(timeout=30)["y"] == 70
    runs = _runs(redis_client)
    assert sorted(r["x"] for r in runs) == [1, 7, 7, 8], "a duplicate was published"
    app.close()
    other.close()
