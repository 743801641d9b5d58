"""The scheduler candidate runs in a child process that never outlives its worker."""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress
from pathlib import Path

import psutil
import pytest
import redis
from celery import Celery

from celery_ojs_ml.leader.process import app_path
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from tests.integration import mlapp
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.integration


def test_the_app_is_found_by_its_module_path_and_a_stray_app_is_not() -> None:
    assert app_path(mlapp.app) == "tests.integration.mlapp:app"
    assert app_path(Celery("stray", set_as_current=False)) is None


def _candidate(worker: WorkerProcess) -> psutil.Process:
    assert worker.proc is not None
    for child in psutil.Process(worker.proc.pid).children():
        if "spawn_main" in " ".join(child.cmdline()):
            return child
    raise AssertionError(f"no scheduler process under {worker.proc.pid}")


def test_the_candidate_process_leads_and_dies_when_its_worker_is_sigkilled(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """SIGKILL of the worker's main process alone (not its group): the child follows it."""
    store = OJSStore(redis_client, prefix="ojs")
    worker = WorkerProcess("solo", redis_url, "profile:nvidia-a100x1", tmp_path)
    try:
        worker.start().wait_live(store)
        book = PendingBook(store)
        deadline = time.monotonic() + 15
        while (book.leader() or {}).get("id") != "solo@test":
            assert time.monotonic() < deadline, "the candidate never led"
            time.sleep(0.1)
        child = _candidate(worker)
        assert worker.proc is not None
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()
        gone, _alive = psutil.wait_procs([child], timeout=5)
        assert child in gone, "the scheduler outlived its worker"
    finally:
        if worker.proc is not None:  # the pool children of the killed main process too
            with suppress(ProcessLookupError):
                os.killpg(worker.proc.pid, signal.SIGKILL)


def test_a_warm_shutdown_resigns_the_lock_at_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Without the resign the lock would stay until its TTL (5 s) ran out."""
    store = OJSStore(redis_client, prefix="ojs")
    worker = WorkerProcess("solo", redis_url, "profile:nvidia-a100x1", tmp_path)
    book = PendingBook(store)
    try:
        worker.start().wait_live(store)
        deadline = time.monotonic() + 15
        while book.leader() is None:
            assert time.monotonic() < deadline, "the candidate never led"
            time.sleep(0.1)
        worker.stop(signal.SIGTERM)
        assert book.leader() is None, "the lock was left to expire"
    finally:
        worker.kill()
