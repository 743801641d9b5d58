"""Routing on RabbitMQ: a real prefork worker runs an ML job pinned and a plain job untouched.

RabbitMQ on 127.0.0.1:5672 (guest/guest) is a test prerequisite on this
machine, so an unreachable broker fails the test with a message instead of
skipping it. The store and the results stay on the session's private Redis.
Each run uses its own `task_default_queue` (and so its own requirement-class
queues), so messages left over from other runs cannot reach this worker, and
the run deletes its queues and exchanges afterwards.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_ojs_ml.spec.classes import BANDS
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture
def amqp_url() -> str:
    """The RabbitMQ URL, after checking that the broker answers."""
    conn = Connection(AMQP_URL, connect_timeout=5)
    try:
        conn.ensure_connection(max_retries=1)
    except Exception as exc:
        pytest.fail(
            f"RabbitMQ is a test prerequisite but {AMQP_URL} is not reachable ({exc}); "
            "start it, e.g. `systemctl start rabbitmq-server` or "
            "`docker run -d -p 5672:5672 rabbitmq:3`"
        )
    finally:
        conn.release()
    return AMQP_URL


@pytest.fixture
def queue(amqp_url: str, redis_client: redis.Redis) -> Iterator[str]:
    """A logical queue unique to this run; its queues and exchanges are deleted afterwards."""
    name = f"ojs-test-{uuid.uuid4().hex[:12]}"
    yield name
    classes = OJSStore(redis_client, prefix="ojs").classes()
    names = [name] + [f"{name}.ml.{cid}.{band}" for cid in classes for band in BANDS]
    _delete(amqp_url, names)


def _delete(url: str, names: list[str]) -> None:
    with Connection(url) as conn:
        for name in names:
            for delete in ("queue_delete", "exchange_delete"):
                channel = conn.channel()
                try:
                    getattr(channel, delete)(name)
                except Exception:  # absent already; the broker closed this channel, not ours
                    pass
                finally:
                    channel.close()


def _exists(url: str, queue: str) -> bool:
    with Connection(url) as conn:
        channel = conn.channel()
        try:
            channel.queue_declare(queue=queue, passive=True)
            return True
        except Exception:
            return False
        finally:
            channel.close()


def _results(client: redis.Redis, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while client.llen(RESULTS_KEY) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    found = [json.loads(raw) for raw in client.lrange(RESULTS_KEY, 0, -1)]
    assert len(found) >= count, f"only {len(found)}/{count} tasks recorded a result"
    return found


def test_on_rabbitmq_an_ml_job_runs_pinned_on_the_gpu_worker_and_a_plain_job_untouched(
    amqp_url: str, redis_url: str, redis_client: redis.Redis, queue: str, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    worker = WorkerProcess(
        "rmq",
        amqp_url,
        "profile:nvidia-a100x2",
        tmp_path,
        concurrency=2,
        results_url=redis_url,
        queue=queue,
        extra_env={"OJS_TEST_STORE": redis_url, "OJS_TEST_QUEUE": queue},
    )
    app = make_app(amqp_url, ojs_ml_store_url=redis_url, task_default_queue=queue)
    try:
        with running([worker], store):
            app.tasks["ml.record"].apply_async(args=["ml"], headers={"ext_ml_gpu_count": 2})
            app.tasks["plain.add"].apply_async(args=[2, 3])
            records = {r["tag"]: r for r in _results(redis_client, 2)}
            scheduled_via = [
                _exists(amqp_url, name) for name in ("ojs.ml.intake", "ojs.ml.w.rmq@test")
            ]
    finally:
        app.close()
    ml, plain = records["ml"], records["plain"]
    assert ml["worker"] == "rmq@test"
    assert sorted(ml["devices"]) == [0, 1]
    assert ml["cvd"] == ",".join(map(str, ml["devices"])), "CUDA_VISIBLE_DEVICES = allocation"
    assert all(scheduled_via), "the ML job went through the intake and the worker's own queue"
    assert (plain["sum"], plain["queue"]) == (5, queue)
    assert plain["headers"] == [] and plain["cvd"] is None, "plain tasks are untouched"
