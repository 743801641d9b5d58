"""A copy the broker delivers again after its run died unleased is never dropped.

The gate marks an assignment `started`, then writes the run's lease a few
milliseconds later (`LeaseWriter`). A worker killed in between leaves a
`started` record, no lease, and the message unacked; kombu restores it to the
worker's queue after its visibility timeout. If that copy then does not fit
(the restarted worker is busy), giving it back must put the job back in the
pending set with this message: it is the job's only copy. Seen in the kill
test as a job that never completed.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
import redis
from kombu import Connection, Producer

from celery_ojs_ml.store.pending import PENDING, PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.headers import ASSIGN as HEADER_ASSIGN
from celery_ojs_ml.wire.queues import ml_queue, worker_queue_name
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def _wait(check: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_copy_delivered_again_after_its_run_died_unleased_is_placed_again_not_dropped(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    store = OJSStore(redis_client, prefix="ojs")
    book = PendingBook(store)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2)
    with running([worker], store):
        busy = record.apply_async(args=["busy", 4.0])
        _wait(lambda: (book.get(busy.id) or {}).get("state") == "started", "the busy job")
        job = record.apply_async(args=["again", 0.1])
        _wait(lambda: (book.get(job.id) or {}).get("state") == PENDING, "the job to wait")
        msg = (book.get(job.id) or {})["msg"]
        # The run that started and died before its lease was written, by hand:
        token = book.assign(job.id, worker.hostname, now=time.time())
        assert token is not None
        assert book.start(job.id, token, worker.hostname) == "ok"
        # ... and the copy kombu restores to the worker's queue, as the scheduler sent it.
        name = worker_queue_name("ojs", worker.hostname)
        with Connection(redis_url) as conn:
            Producer(conn.channel()).publish(  # type: ignore[no-untyped-call]
                base64.b64decode(msg["body"]),
                exchange=name,
                routing_key=name,
                headers={**msg["headers"], HEADER_ASSIGN: token},
                content_type=msg["content_type"],
                content_encoding=msg["content_encoding"],
                declare=[ml_queue(name)],
            )
        _wait(lambda: redis_client.llen(RESULTS_KEY) >= 2, "both jobs to run", timeout=60)
        time.sleep(0.5)  # nothing runs twice afterwards
    runs = {}
    for raw in redis_client.lrange(RESULTS_KEY, 0, -1):
        run = json.loads(raw)
        assert run["task_id"] not in runs, f"{run['task_id']} ran twice"
        runs[run["task_id"]] = run
    assert sorted(runs) == sorted([busy.id, job.id]), "the job was lost"
    assert runs[job.id]["start"] >= runs[busy.id]["end"] - 0.05, "it ran beside the busy job"
    log = (tmp_path / "a.log").read_text()
    assert f"{job.id} was delivered again after its run died unleased" in log
    app.close()
