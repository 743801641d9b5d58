"""Every way a job reaches a worker survives a SIGKILL of that worker the moment it
has taken the job off its queue (DESIGN decision 10, invariant 5).

kombu's Redis transport takes a message off its list with `BRPOP` and only then
records it as unacked, so a worker killed in between leaves the message in
neither place. The tests make that instant certain: they SIGSTOP the worker, send
it a job (by a grant, by an assignment, by an assignment sent ahead of capacity),
take the message off the worker's lists themselves if the stopped worker's pending
`BRPOP` did not (Redis hands a blocked client its message whether the process
runs or not), then SIGKILL the worker and start another. Each job must then
complete exactly once, well before kombu's visibility timeout (an hour here).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.queues import PRIORITY_SUFFIXES, intake_name, worker_queue_name
from tests.integration.mlapp import make_app
from tests.integration.test_fleet import SPOT, _result, _wait, _worker
from tests.integration.test_grants import _warm
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

BOUND_S = 60.0
"""Lease TTL (3 s) + leader lock TTL + assignment timeout + start-up, with room."""


def _conf(**extra: Any) -> str:
    return json.dumps(
        {
            "ojs_ml_heartbeat_s": 0.5,
            "ojs_ml_lease_ttl_s": 3,
            "ojs_ml_assignment_timeout_s": 5,
            "ojs_ml_grant_wait_s": 30,
            **extra,
        }
    )


def _lists(queue: str) -> list[str]:
    return [queue + suffix for suffix in PRIORITY_SUFFIXES]


def _take_off(client: redis.Redis, worker: WorkerProcess) -> list[dict[str, Any]]:
    """What a stopped worker's `BRPOP` did not take yet, taken off its lists as it would."""
    taken = []
    for key in _lists(worker_queue_name("ojs", worker.hostname)):
        while (raw := client.rpop(key)) is not None:
            taken.append(json.loads(raw))
    return taken


def _in_intake(client: redis.Redis, task_id: str) -> bool:
    for key in _lists(intake_name("ojs")):
        for raw in client.lrange(key, 0, -1):
            if json.loads(raw).get("headers", {}).get("id") == task_id:
                return True
    return False


def _stop(worker: WorkerProcess) -> None:
    assert worker.proc is not None
    os.kill(worker.proc.pid, signal.SIGSTOP)


def _advertised_idle(store: OJSStore, worker: WorkerProcess) -> bool:
    found = store.live_workers().get(worker.hostname)
    return found is not None and not (found.get("free") or {}).get("allocations", [None])


def _fresh_idle(store: OJSStore, worker: WorkerProcess) -> bool:
    """Idle, and advertised within the last 0.2 s: the stopped worker then stays live
    (three heartbeats) as long as it can, for the leader to assign it a job."""
    found = store.live_workers().get(worker.hostname) or {}
    return _advertised_idle(store, worker) and time.time() - float(found.get("ts", 0)) < 0.2


def _completed_once(client: redis.Redis, task_id: str, what: str) -> None:
    _wait(lambda: _result(client, task_id), BOUND_S, what)
    time.sleep(1.0)  # a second copy, if any, would finish about now
    assert _result(client, task_id) is not None  # `_result` fails on two completions


def test_a_granted_job_taken_by_a_holder_killed_at_once_completes_exactly_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = _conf(ojs_ml_grants=True)
    monkeypatch.setenv("OJS_TEST_CONF", conf)
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    doomed = _worker("doomed", redis_url, "nvidia-a100x1", tmp_path, conc=2, OJS_TEST_CONF=conf)
    spare = _worker("spare", redis_url, "nvidia-a100x1", tmp_path, conc=2, OJS_TEST_CONF=conf)
    with running([doomed], store):
        _warm(app, redis_client, store, "doomed", SPOT)
        _stop(doomed)
        job = record.apply_async(args=["granted", 0.1], headers=SPOT).id
        time.sleep(0.3)
        taken = _take_off(redis_client, doomed)
        assert all(m["headers"].get(h.GRANT) for m in taken), "sent under a grant"
        assert not _in_intake(redis_client, job), "the job went to the intake, not the holder"
        assert PendingBook(store).get(job) is None or taken == [], "not a granted delivery"
        doomed.kill()
    with running([spare], store):
        _completed_once(redis_client, job, "the granted job its holder took")
    app.close()


def test_an_assigned_job_taken_by_a_worker_killed_at_once_completes_exactly_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # live for 3 s once stopped (three heartbeats): time for the leader to assign it the job
    conf = _conf(ojs_ml_grants=False, ojs_ml_heartbeat_s=1.0)
    monkeypatch.setenv("OJS_TEST_CONF", conf)
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    doomed = _worker("doomed", redis_url, "nvidia-a100x1", tmp_path, conc=1, OJS_TEST_CONF=conf)
    spare = _worker("spare", redis_url, "nvidia-a100x1", tmp_path, conc=1, OJS_TEST_CONF=conf)
    book = PendingBook(store)
    with running([doomed], store):
        warm = record.apply_async(args=["warm", 0.0], headers=SPOT).id
        _wait(lambda: _result(redis_client, warm), 30, "the first job")
        # its result is stored inside the task: the worker advertises its GPU free after
        _wait(lambda: _fresh_idle(store, doomed), 10, "the worker advertising its GPU free")
        _stop(doomed)
        job = record.apply_async(args=["assigned", 0.1], headers=SPOT).id
        _wait(lambda: (book.get(job) or {}).get("state") == "assigned", 10, "the assignment")
        assert (book.get(job) or {}).get("worker") == doomed.hostname
        time.sleep(0.3)
        _take_off(redis_client, doomed)
        doomed.kill()
    with running([spare], store):
        _completed_once(redis_client, job, "the assigned job its worker took")
    app.close()


def test_a_job_sent_ahead_and_taken_by_a_worker_killed_at_once_completes_exactly_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = _conf(ojs_ml_grants=False, ojs_ml_prefetch=1, ojs_ml_max_hold_s=30)
    monkeypatch.setenv("OJS_TEST_CONF", conf)
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    doomed = _worker("doomed", redis_url, "nvidia-a100x1", tmp_path, conc=2, OJS_TEST_CONF=conf)
    spare = _worker("spare", redis_url, "nvidia-a100x1", tmp_path, conc=2, OJS_TEST_CONF=conf)
    book = PendingBook(store)
    long = {**SPOT, "ext_ml_timeout_seconds": 6}  # a planned start within max_hold_s / 2
    with running([doomed], store):
        first = record.apply_async(args=["first", 3.0], headers=long).id
        _wait(lambda: (book.get(first) or {}).get("state") == "started", 20, "the first job")
        job = record.apply_async(args=["ahead", 0.1], headers=long).id
        _wait(lambda: (book.get(job) or {}).get("state") == "assigned", 10, "the job sent ahead")
        _stop(doomed)
        time.sleep(0.3)
        _take_off(redis_client, doomed)
        doomed.kill()
    with running([spare], store):
        _completed_once(redis_client, job, "the job sent ahead")
        _completed_once(redis_client, first, "the running job (its lease)")
    app.close()
