"""A job that committed its final checkpoint never runs its body again (invariant 5).

A worker killed after the body's final commit (`ckpt.save(final=True, result=...)`)
but before Celery stored the result leaves the job to be delivered again: its lease is
claimed by another worker, or a copy is already queued. Both paths read the final
record instead of running the body from the final checkpoint once more: the claimer
releases the lease and stores the recorded result, and the gate settles a copy the
same way (`worker.finished`). The test stands in for the killed run by writing the
final record (and the dead worker's lease) itself.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import redis

from celery_ojs_ml.store.checkpoints import Keys
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.records import job_record
from tests.integration.mlapp import make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

RECORDED = {"epochs": 4, "from": "the final checkpoint"}


def _worker(tmp_path: Path, redis_url: str) -> WorkerProcess:
    env = {"OJS_TEST_CKPT": str(tmp_path / "ckpt"), "OJS_TEST_LEASE_TTL": "2"}
    return WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, extra_env=env)


def _final(store: OJSStore, task_id: str) -> None:
    record = {"result": RECORDED, "sequence": 4}
    store.client.set(Keys.of(store, task_id).final, json.dumps(record))


def test_a_copy_of_a_job_whose_final_checkpoint_is_committed_gets_its_recorded_result_unrun(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    task_id = str(uuid.uuid4())
    _final(store, task_id)
    with running([_worker(tmp_path, redis_url)], store):
        result = app.tasks["ml.ckpt_train"].apply_async(args=[4, 0.1], task_id=task_id)
        assert result.get(timeout=60) == RECORDED
        other = app.tasks["ml.ckpt_train"].apply_async(args=[2, 0.05])  # not final: it runs
        assert other.get(timeout=60) == 2
    assert redis_client.lrange(f"ojs-test:runs:{task_id}", 0, -1) == [], "the body ran again"
    assert len(redis_client.lrange(f"ojs-test:runs:{other.id}", 0, -1)) == 1
    log = (tmp_path / "a.log").read_text()
    assert f"{task_id} committed its final checkpoint (4) in an earlier run" in log
    app.close()


def test_a_dead_workers_lease_whose_job_committed_its_final_checkpoint_is_released_not_rerun(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    task_id = str(uuid.uuid4())
    _final(store, task_id)
    headers = {"ext_ml_gpu_count": 1, "ext_ml_checkpoint_enabled": True}
    record = job_record(task_id, "ml.ckpt_train", [4, 0.1], {}, headers)
    dead = {**record, "worker": "gone@test", "incarnation": "x", "devices": [0]}
    LeaseBook(store, ttl_s=0.01).take({**dead, "started_at": time.time(), "time_limit_s": None})
    with running([_worker(tmp_path, redis_url)], store):
        assert app.AsyncResult(task_id).get(timeout=60) == RECORDED
        deadline = time.monotonic() + 30
        while redis_client.exists(store.lease_key(task_id)):
            assert time.monotonic() < deadline, "the claimed lease was never released"
            time.sleep(0.1)
        time.sleep(1.0)  # a re-published copy would have started by now
    assert redis_client.lrange(f"ojs-test:runs:{task_id}", 0, -1) == [], "it was re-run"
    log = (tmp_path / "a.log").read_text()
    assert f"{task_id} committed its final checkpoint before its worker died" in log
    assert f"re-publishing ml.ckpt_train[{task_id}]" not in log
    app.close()
