"""OJS ML §14.3 on a real worker: `ext_ml_timeout_seconds` stops the job and frees its GPUs.

The router turns the attribute into the message's hard time limit; this test
checks the other half, that a prefork worker enforces it. A job that would
sleep 30 s with a 1 s timeout must end as a TimeLimitExceeded failure within a
few seconds without ever finishing its body, and the only GPU of the worker
must be free at once for the next job (not after the 30 s lease TTL).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC
from pathlib import Path

import pytest
import redis
from billiard.exceptions import TimeLimitExceeded
from celery import Celery
from celery.result import AsyncResult

from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

SLEEP_S = 30
TIMEOUT_S = 1
STOPPED_WITHIN_S = 6.0
"""1 s limit, plus the pool's timer and the kill; far below the 30 s the body would take."""


@pytest.fixture
def ojs_store(redis_client: redis.Redis) -> OJSStore:
    return OJSStore(redis_client, prefix="ojs")


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    app = make_app(redis_url)
    yield app
    app.close()


def _wait(predicate: object, timeout: float, what: str, worker: WorkerProcess) -> float:
    """Poll until `predicate()` holds; the time it first held."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} within {timeout} s:\n{worker.output()[-3000:]}"
        time.sleep(0.02)
    return time.time()


def _recorded(client: redis.Redis, tag: str) -> dict[str, object] | None:
    found = [json.loads(raw) for raw in client.lrange(RESULTS_KEY, 0, -1)]
    return next((r for r in found if r["tag"] == tag), None)


@pytest.mark.timeout(90)
def test_a_job_past_its_timeout_seconds_fails_with_time_limit_exceeded_and_frees_its_gpu(
    app: Celery, redis_url: str, redis_client: redis.Redis, ojs_store: OJSStore, tmp_path: Path
) -> None:
    worker = WorkerProcess("timeout", redis_url, "profile:nvidia-l4x1", tmp_path, concurrency=2)
    leases = LeaseBook(ojs_store, ttl_s=30)
    with running([worker], ojs_store):
        slow = app.tasks["ml.record"].apply_async(
            args=["slow", SLEEP_S],
            kwargs={"cuda": False},
            headers={"ext_ml_timeout_seconds": TIMEOUT_S},
        )
        started = _wait(lambda: leases.get(slow.id), 15, "the slow job never started", worker)
        # Published while the slow job holds the worker's only GPU: it can run only once freed.
        after = app.tasks["ml.record"].apply_async(args=["after"], kwargs={"cuda": False})
        failed = _wait(lambda: slow.ready(), 15, "the slow job never ended", worker)
        ran = _wait(lambda: _recorded(redis_client, "after"), 10, "the next job never ran", worker)
        after.get(timeout=5)
        assert _wait(lambda: not leases.all(), 5, "a lease was left behind", worker)

    result = AsyncResult(slow.id, app=app)
    assert result.state == "FAILURE"
    assert isinstance(result.result, TimeLimitExceeded), repr(result.result)
    assert failed - started < STOPPED_WITHIN_S
    assert _recorded(redis_client, "slow") is None, "the body ran to the end"
    record = _recorded(redis_client, "after")
    assert record is not None
    assert record["devices"] == [0]
    # The next job started after the slow one was stopped (one GPU: never beside it), and
    # at once: freed by the time-limit handler, not by the 30 s lease expiry.
    done = result.date_done
    done = done if done.tzinfo else done.replace(tzinfo=UTC)  # the backend stores UTC
    assert float(record["start"]) >= done.timestamp()  # type: ignore[arg-type]
    assert ran - failed < 5.0
