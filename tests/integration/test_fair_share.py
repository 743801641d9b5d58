"""Fair sharing between queues on a real worker (`ojs_ml_fair_share`, weights 3:1).

One 4-GPU worker consumes `train` and `infer`. Twelve 1-s `train` jobs are
published first, then twelve `infer` jobs. In plain fleet order (FIFO) every
GPU goes to `train` until its jobs are gone; with weights 3:1 `infer` gets
about one GPU of four while both queues wait. Jobs are delivered ahead to a
gate (`ojs_ml_prefetch`, on by default) only where their start cannot push
their queue past its share: a gate starts them whichever queue's job ends.
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
    # Published before the worker (and its scheduler) starts.
    train = [record.apply_async(args=[f"t{i}", 1.0], queue="train").id for i in range(12)]
    infer = [record.apply_async(args=[f"i{i}", 1.0], queue="infer").id for i in range(12)]
    with running([worker], store):
        deadline = time.monotonic() + 60
        while len(_results(redis_client)) < 24 and time.monotonic() < deadline:
            time.sleep(0.1)
    runs = {r["task_id"]: r for r in _results(redis_client)}
    assert sorted(runs) == sorted(train + infer), "every job ran exactly once"
    last_train = max(runs[i]["start"] for i in train)
    early = [i for i in infer if runs[i]["start"] < last_train - 0.5]
    # FIFO: none (train was first); 3:1 over ~4 s of contention: about 3 or 4.
    assert len(early) >= 2, f"infer started {len(early)} jobs while train still waited"
    peak = max(sum(1 for i in infer if runs[i]["start"] <= t < runs[i]["end"])
               for t in (runs[j]["start"] for j in train))  # fmt: skip
    assert peak <= 2, f"infer held {peak} of 4 GPUs while train waited (weight 1 of 4)"
    app.close()


def test_a_queue_alone_under_weights_still_gets_its_next_jobs_ahead_of_capacity(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Prefetch (on by default) works with weights: where every job on a worker is of
    one queue, the next one takes the place of one of them at the gate (`AheadShares`)."""
    store = OJSStore(redis_client, prefix="ojs")
    conf = json.dumps({"ojs_ml_fair_share": WEIGHTS})
    worker = WorkerProcess(
        "four", redis_url, "profile:nvidia-a100x4", tmp_path, concurrency=6,
        queue="train,infer", extra_env={"OJS_TEST_CONF": conf},
    )  # fmt: skip
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    train = [record.apply_async(args=[f"t{i}", 1.0], queue="train").id for i in range(12)]
    with running([worker], store):
        deadline = time.monotonic() + 60
        while len(_results(redis_client)) < 12 and time.monotonic() < deadline:
            time.sleep(0.1)
    runs = [r["task_id"] for r in _results(redis_client)]
    assert sorted(runs) == sorted(train), "every job ran exactly once"
    log = (tmp_path / "four.log").read_text()
    ahead = [i for i in train if f"assigned {i} to four@test (ahead of capacity" in log]
    assert ahead, "with weights, no job was delivered ahead of capacity"
    app.close()
