"""Fencing (DESIGN invariant 5): a stalled worker whose lease was taken over stops its copy.

Worker `stall` runs a checkpointed job; its main process is frozen (SIGSTOP)
while its pool child keeps training, as in a partition from the store. After
`ojs_ml_lease_ttl_s` (2 s here) worker `taker` claims the lease and runs the
job from its last checkpoint. When `stall` wakes up, its next lease heartbeat
sees another token on the lease and kills its own child: the job completes
once, on `taker`, and the stalled copy records no completion.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.integration.leases import LeaseBook
from celery_ojs_ml.store import OJSStore
from tests.integration.mlapp import make_app
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.integration


def _until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_stalled_worker_whose_lease_was_taken_over_kills_its_copy(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    leases = LeaseBook(store, ttl_s=2)
    env = {"OJS_TEST_LEASE_TTL": "2", "OJS_TEST_CKPT": str(tmp_path / "ckpt")}
    stall = WorkerProcess("stall", redis_url, "profile:nvidia-a100x2", tmp_path, extra_env=env)
    taker = WorkerProcess("taker", redis_url, "profile:nvidia-a100x2", tmp_path, extra_env=env)
    app = make_app(redis_url)
    runs_key = ""

    def runs() -> list[dict[str, Any]]:
        return [json.loads(r) for r in redis_client.lrange(runs_key, 0, -1)]

    try:
        stall.start().wait_live(store)
        job = app.tasks["ml.ckpt_train"].apply_async(args=[40, 0.25])
        runs_key = f"ojs-test:runs:{job.id}"
        _until(lambda: (leases.get(job.id) or {}).get("worker") == "stall@test", 30, "the lease")
        _until(lambda: runs() and runs()[0].get("epoch", -1) >= 1, 30, "two epochs on stall")
        assert stall.proc is not None
        os.kill(stall.proc.pid, signal.SIGSTOP)  # the main process stalls; its child trains on
        taker.start().wait_live(store)
        _until(lambda: len(runs()) >= 2, 60, "the taker's run of the re-published job")
        first = runs()[0]
        assert first["worker"] == "stall@test" and _alive(first["pid"])
        os.kill(stall.proc.pid, signal.SIGCONT)
        _until(lambda: "was taken over by another worker" in stall.output(), 20, "the fence")
        _until(lambda: not _alive(first["pid"]), 20, "the stalled copy's child to die")
        _until(lambda: redis_client.get(f"ojs-test:done:{job.id}"), 60, "the job to complete")
        time.sleep(1.0)  # a late completion of the stalled copy would show up here
    finally:
        if stall.proc is not None and stall.proc.poll() is None:
            os.kill(stall.proc.pid, signal.SIGCONT)
        stall.stop()
        taker.stop()
        app.close()
    final = runs()
    assert int(redis_client.get(f"ojs-test:done:{job.id}") or 0) == 1, final
    assert not final[0].get("done"), "the stalled copy was stopped before it finished"
    assert final[-1]["worker"] == "taker@test" and final[-1].get("done"), final
    assert final[-1]["crashes"] >= 1 and final[-1]["start_epoch"] >= 1, final
    assert "stopped this copy of" in stall.output()
    assert leases.get(job.id) is None, "the finished job's lease was released"


def test_a_lease_that_vanished_from_the_store_is_written_again_not_fenced(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A store restarted without persistence must not make workers kill their jobs."""
    store = OJSStore(redis_client, prefix="ojs")
    leases = LeaseBook(store, ttl_s=30)
    env = {"OJS_TEST_CKPT": str(tmp_path / "ckpt")}
    worker = WorkerProcess("keep", redis_url, "profile:nvidia-a100x2", tmp_path, extra_env=env)
    app = make_app(redis_url)
    try:
        worker.start().wait_live(store)
        job = app.tasks["ml.ckpt_train"].apply_async(args=[12, 0.25])
        lease = _until(lambda: leases.get(job.id), 30, "the lease")
        redis_client.delete(store.key("lease", job.id))  # as after an empty restart
        again = _until(lambda: leases.get(job.id), 10, "the lease to be written again")
        assert again["token"] == lease["token"] and again["worker"] == "keep@test"
        _until(lambda: redis_client.get(f"ojs-test:done:{job.id}"), 60, "the job to complete")
    finally:
        worker.stop()
        app.close()
    output = worker.output()
    assert "had vanished from the store; rewritten" in output
    assert "taken over" not in output
    runs = [json.loads(r) for r in redis_client.lrange(f"ojs-test:runs:{job.id}", 0, -1)]
    assert len(runs) == 1 and runs[0].get("done"), runs
