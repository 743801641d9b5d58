"""An assigned copy is never dropped for want of its store (invariant 5).

A store restarted without its data (no persistence, or a failover that lost the last
writes) forgets the pending records of assigned jobs whose copies are already on a
worker's queue. Such a copy is then the job's only copy. If it fits, the gate runs it
(`unknown`); if it does not fit, giving the assignment back finds no record to put the
job back into, so the copy goes back to the intake with its message, and the leader
admits and places it again. Dropping it there lost the job. Likewise a copy whose
assignment the gate cannot claim because the store does not answer waits for the store
on its queue; refusing it as a bad message failed the job.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis
from kombu import Connection, Producer

from bench.chaos_servers import RedisServer
from celery_ojs_ml.store.pending import PENDING, PendingBook
from celery_ojs_ml.store.pending_records import job_key
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.headers import ASSIGN as HEADER_ASSIGN
from celery_ojs_ml.wire.queues import ml_queue, worker_queue_name
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running, wait_for_leader

pytestmark = pytest.mark.integration


def _wait(check: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_an_assigned_copy_that_does_not_fit_and_whose_record_the_store_lost_is_admitted_again(
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
        job = record.apply_async(args=["orphan", 0.1])
        _wait(lambda: (book.get(job.id) or {}).get("state") == PENDING, "the job to wait")
        msg = (book.get(job.id) or {})["msg"]
        # The store forgets the job's record (a restart without its data) ...
        redis_client.delete(job_key(store, job.id))
        redis_client.zrem(book.index_key, job.id)
        # ... while the copy the leader assigned to the worker is on the worker's queue.
        name = worker_queue_name("ojs", worker.hostname)
        with Connection(redis_url) as conn:
            Producer(conn.channel()).publish(  # type: ignore[no-untyped-call]
                base64.b64decode(msg["body"]),
                exchange=name,
                routing_key=name,
                headers={**msg["headers"], HEADER_ASSIGN: "token-the-store-lost"},
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
    assert f"the store has no record of {job.id}; back to the intake" in log
    app.close()


def test_an_assigned_copy_the_gate_cannot_claim_while_the_store_is_down_runs_once_it_is_back(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The gate claims an assignment in the store before it starts it. A store that does
    not answer at that moment is an outage, not a bad message: the copy must not be
    refused (failed and dropped), but go back to its queue until the store answers."""
    server = RedisServer("store", tmp_path).start()  # with an AOF: a restart keeps the record
    store = OJSStore.from_url(server.url, prefix="ojs")
    book = PendingBook(store)
    app = make_app(redis_url, ojs_ml_store_url=server.url)
    # a heartbeat of 3 s: the stopped worker stays advertised (3 heartbeats) to be assigned
    env = {"OJS_TEST_STORE": server.url, "OJS_TEST_CONF": '{"ojs_ml_heartbeat_s": 3}'}
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, extra_env=env)
    try:
        with running([worker], store):
            wait_for_leader(store)
            assert worker.proc is not None
            os.kill(worker.proc.pid, signal.SIGSTOP)  # its scheduler candidate runs on
            try:
                job = app.tasks["ml.record"].apply_async(
                    args=["outage", 0.1], kwargs={"cuda": False}
                )
                _wait(lambda: (book.get(job.id) or {}).get("state") == "assigned", "the assignment")
                server.stop()
            finally:
                os.kill(worker.proc.pid, signal.SIGCONT)
            _wait(lambda: "the store does not answer" in worker.output(), "the gate to try")
            server.start()
            assert app.AsyncResult(job.id).get(timeout=60)["tag"] == "outage"
            time.sleep(1.0)  # a second run would show by now
    finally:
        server.stop()
        app.close()
    runs = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert [r["task_id"] for r in runs] == [job.id], runs
    assert "refusing" not in worker.output()
