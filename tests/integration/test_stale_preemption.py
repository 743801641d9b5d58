"""A preemption request is never a way to lose a job (OJS ML §8.2, invariant 5).

The request is a Redis key with a TTL (the grace period plus a margin) that the task's
checkpoint helper polls. Two ways it reached a copy its worker had not preempted:
* a request made outside the worker (the key is how a controller or another host asks);
* a request left over from an earlier copy: the preempting worker was SIGKILLed during
  the grace period, its lease was claimed and the job re-published, and the new copy
  found the old key.
The copy yielded (`Preempted`), and its worker, which had preempted nothing, ended it as
an ignored task: the job was gone. Now a yield is always re-published as a preemption,
and a claimer withdraws the dead copy's request before it re-publishes the job.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.checkpoint import request_preemption
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.records import job_record
from tests.integration.mlapp import make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def _worker(tmp_path: Path, redis_url: str) -> WorkerProcess:
    env = {"OJS_TEST_CKPT": str(tmp_path / "ckpt"), "OJS_TEST_LEASE_TTL": "2"}
    return WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, extra_env=env)


def _runs(client: redis.Redis, task_id: str) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(f"ojs-test:runs:{task_id}", 0, -1)]


def test_a_job_that_yields_to_a_request_its_worker_did_not_make_is_re_published_and_completes(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    with running([_worker(tmp_path, redis_url)], store):
        job = app.tasks["ml.ckpt_train"].apply_async(args=[12, 0.25])
        deadline = time.monotonic() + 30
        while not any(r.get("epoch", -1) >= 1 for r in _runs(redis_client, job.id)):
            assert time.monotonic() < deadline, "the job never got going"
            time.sleep(0.05)
        request_preemption(store, job.id, grace_s=30)  # asked from outside the worker
        assert job.get(timeout=60) == 12, "the job that yielded was lost"
    runs = _runs(redis_client, job.id)
    assert len(runs) == 2 and runs[-1]["preemptions"] == 1 and runs[-1]["start_epoch"] > 0, runs
    app.close()


def test_a_dead_copys_preemption_request_does_not_preempt_the_copy_its_claimer_publishes(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    task_id = str(uuid.uuid4())
    headers = {"ext_ml_gpu_count": 1, "ext_ml_checkpoint_enabled": True}
    record = job_record(task_id, "ml.ckpt_train", [6, 0.25], {}, headers)
    dead = {**record, "worker": "gone@test", "incarnation": "x", "devices": [0]}
    LeaseBook(store, ttl_s=0.01).take({**dead, "started_at": time.time(), "time_limit_s": None})
    request_preemption(store, task_id, grace_s=30)  # the dead worker was preempting it
    with running([_worker(tmp_path, redis_url)], store):
        assert app.AsyncResult(task_id).get(timeout=60) == 6
    runs = _runs(redis_client, task_id)
    assert [(r["crashes"], r["preemptions"]) for r in runs] == [(1, 0)], runs
    app.close()
