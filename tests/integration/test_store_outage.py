"""A store outage: publishing fails cleanly, and a real worker rides out a store restart.

The store is its own redis-server here (the broker stays up), started and
restarted empty by the test, as when a store host reboots without persistence.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ojs_ml.errors import StoreUnavailable
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.registry import OJSStore
from tests.helpers import free_port, stop_process
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


class StoreServer:
    """A redis-server on a fixed loopback port that can be stopped and started empty."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is a test prerequisite"
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.workdir)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the store did not start"
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


@pytest.fixture
def server(tmp_path: Path) -> Iterator[StoreServer]:
    server = StoreServer(tmp_path)
    server.start()
    yield server
    server.stop()


def _broker_messages(client: redis.Redis) -> int:
    total = 0
    for key in client.keys("*"):
        if client.type(key) == b"list" and not key.startswith((b"ojs-test", b"celery-task-meta")):
            total += int(client.llen(key))
    return total


def test_publishing_during_a_store_outage_raises_one_error_naming_the_store_and_publishes_nothing(
    redis_url: str, redis_client: redis.Redis
) -> None:
    port = free_port()
    app = make_app(redis_url, ojs_ml_store_url=f"redis://:s3cret@127.0.0.1:{port}/0")
    try:
        before = _broker_messages(redis_client)
        with pytest.raises(StoreUnavailable) as info:
            app.tasks["ml.record"].apply_async(args=["during-outage"])
        message = str(info.value)
        assert f"redis://:***@127.0.0.1:{port}/0" in message and "nothing was published" in message
        assert "s3cret" not in message
        assert _broker_messages(redis_client) == before
        app.tasks["plain.add"].apply_async(args=[1, 2])  # plain tasks never need the store
        assert _broker_messages(redis_client) == before + 1
    finally:
        app.close()


def _wait(what: str, check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except redis.ConnectionError:
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _lease_of(leases: LeaseBook, task_id: str) -> list[dict[str, Any]]:
    return [x for x in leases.all() if x["task_id"] == task_id]


def _ran(client: redis.Redis, tag: str) -> bool:
    return any(json.loads(r)["tag"] == tag for r in client.lrange(RESULTS_KEY, 0, -1))


def test_a_worker_rides_out_a_store_restart_and_rewrites_its_leases(
    redis_url: str, redis_client: redis.Redis, server: StoreServer, tmp_path: Path
) -> None:
    store = OJSStore.from_url(server.url)
    worker = WorkerProcess(
        "outage", redis_url, "profile:nvidia-l4x1", tmp_path, concurrency=2,
        extra_env={"OJS_TEST_STORE": server.url},
    )  # fmt: skip
    app: Celery = make_app(redis_url, ojs_ml_store_url=server.url)
    with running([worker], store):
        long = app.tasks["ml.record"].apply_async(args=["long", 8.0], kwargs={"cuda": False})
        leases = LeaseBook(store, ttl_s=30)
        _wait("the first lease", lambda: _lease_of(leases, long.id))
        server.stop()
        fresh = make_app(redis_url, ojs_ml_store_url=server.url)
        with pytest.raises(StoreUnavailable):
            fresh.tasks["ml.record"].apply_async(args=["refused"])
        fresh.close()
        time.sleep(1.5)  # a few heartbeats fail while the store is down
        server.start()  # empty: no registry, no workers, no leases
        _wait("the worker to re-advertise", lambda: worker.hostname in store.live_workers())
        _wait(
            "the lease to be rewritten",
            lambda: [x for x in leases.all() if x["task_id"] == long.id],
        )
        after = make_app(redis_url, ojs_ml_store_url=server.url)
        after.tasks["ml.record"].apply_async(args=["after-restart"], kwargs={"cuda": False})
        _wait("the job published after the restart", lambda: _ran(redis_client, "after-restart"))
        _wait("the long job", lambda: _ran(redis_client, "long"))
        after.close()
        assert worker.proc is not None and worker.proc.poll() is None
    app.close()
    store.close()
    assert not _ran(redis_client, "refused")
