"""Fair sharing between queues on a real worker (`ojs_ml_fair_share`, weights 3:1).

One 4-GPU worker consumes `train` and `infer`. Eight 1-GPU `train` jobs are
published first, then eight `infer` jobs. In plain fleet order (FIFO) every
GPU goes to `train` until its jobs are gone; with weights 3:1 `infer` gets
one GPU from the first pass on, and `train` three.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration
WEIGHTS = {"train": 3, "infer": 1}


def _results(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(RESULTS_KEY, 0, -1)]


def test_competing_queues_share_the_gpus_by_weight(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    conf = json.dumps({"ojs_ml_fair_share": WEIGHTS})
    worker = WorkerProcess(
        "four", redis_url, "profile:nvidia-a100x4", tmp_path, concurrency=6,
        queue="train,infer", extra_env={"OJS_TEST_CONF": conf},
    )  # fmt: skip
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    with running([worker], store):
        app.ojs_ml.cancel("warm-up")  # the app's store connection is ready before timing
        train = [record.apply_async(args=[f"t{i}", 1.5], queue="train").id for i in range(8)]
        infer = [record.apply_async(args=[f"i{i}", 1.5], queue="infer").id for i in range(8)]
        deadline = time.monotonic() + 60
        while len(_results(redis_client)) < 16 and time.monotonic() < deadline:
            time.sleep(0.1)
    runs = {r["task_id"]: r for r in _results(redis_client)}
    assert sorted(runs) == sorted(train + infer), "every job ran exactly once"
    first = min(r["start"] for r in runs.values())
    early = [r for r in runs.values() if r["start"] < first + 1.0]  # the first wave
    tags = sorted(r["tag"][0] for r in early)
    assert tags == ["i", "t", "t", "t"], f"first wave {tags}: not shared 3:1"
    app.close()
