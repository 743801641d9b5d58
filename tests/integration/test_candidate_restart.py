"""A worker whose scheduler candidate process died starts another (DESIGN decision 9).

The candidate runs in a process of its own, spawned by the worker. Killed on its own
(the out-of-memory killer, an operator, a crash), it left its worker without a
candidate, and a fleet whose candidates had all died had no scheduler: admitted jobs
waited forever. The worker now starts a new candidate at its next heartbeat.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import redis

from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import make_app
from tests.integration.workers import WorkerProcess, running, wait_for_leader

pytestmark = pytest.mark.integration


def _candidate(worker: WorkerProcess) -> int | None:
    assert worker.proc is not None
    for child in psutil.Process(worker.proc.pid).children():
        try:
            if any("spawn_main" in part for part in child.cmdline()):
                return int(child.pid)
        except psutil.Error:  # the killed one, until its parent reaps it
            continue
    return None


def test_a_worker_whose_scheduler_candidate_was_killed_starts_another_and_jobs_run(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2)
    with running([worker], store):
        wait_for_leader(store)
        first = _candidate(worker)
        assert first is not None, "the candidate runs in a process of its own"
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (again := _candidate(worker)) in (None, first):
            assert time.monotonic() < deadline, "no new candidate was started"
            time.sleep(0.1)
        job = app.tasks["ml.record"].apply_async(args=["after", 0.0], kwargs={"cuda": False})
        assert job.get(timeout=60)["tag"] == "after"
        assert (PendingBook(store).leader() or {}).get("id") == worker.hostname
    assert again != first
    assert "the scheduler candidate (pid" in worker.output()
    app.close()
