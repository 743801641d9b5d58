"""Publish side against a real (private) Redis: routing, headers, validation, plain tasks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.plugin import OJSML
from celery_ojs_ml.spec.classes import class_id
from celery_ojs_ml.spec.normalize import normalize


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    app = Celery("routing-test", broker=redis_url, set_as_current=False)
    app.conf.task_create_missing_queues = True
    OJSML(app)

    @app.task(
        name="ml.train", shared=False, ml={"ext_ml_gpu_type": "nvidia-a100", "ext_ml_gpu_count": 2}
    )
    def train(cfg: Any) -> Any:
        return cfg

    @app.task(name="plain.add", shared=False)
    def add(a: int, b: int) -> int:
        return a + b

    yield app
    app.close()


def _messages(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(queue, 0, -1)]


def test_an_ml_task_lands_in_the_scheduler_intake_with_canonical_headers(
    app: Celery, redis_client: redis.Redis
) -> None:
    app.tasks["ml.train"].apply_async(args=[{"lr": 0.1}])
    cid = class_id(
        normalize({"ext_ml_gpu_type": "nvidia-a100", "ext_ml_gpu_count": 2}).requirements
    )
    [msg] = _messages(redis_client, "ojs.ml.intake")
    headers = msg["headers"]
    assert headers["ext_ml_gpu_count"] == 2
    assert headers["ext_ml_accelerator"] == "gpu"
    assert (headers["ojs_class"], headers["ojs_band"]) == (cid, "on-demand")


def test_per_call_headers_override_the_task_declaration(
    app: Celery, redis_client: redis.Redis
) -> None:
    app.tasks["ml.train"].apply_async(args=[{}], headers={"ext_ml_gpu_count": 4})
    cid = class_id(
        normalize({"ext_ml_gpu_type": "nvidia-a100", "ext_ml_gpu_count": 4}).requirements
    )
    [msg] = _messages(redis_client, "ojs.ml.intake")
    assert msg["headers"]["ext_ml_gpu_count"] == 4
    assert msg["headers"]["ojs_class"] == cid


def test_an_invalid_requirement_raises_at_apply_async_and_nothing_is_published(
    app: Celery, redis_client: redis.Redis
) -> None:
    before = set(redis_client.keys("*"))
    with pytest.raises(SpecError, match="ext_ml_gpu_count is 0 but ext_ml_gpu_type is set"):
        app.tasks["ml.train"].apply_async(args=[{}], headers={"ext_ml_gpu_count": 0})
    published = {k for k in set(redis_client.keys("*")) - before if not k.startswith(b"ojs:")}
    assert published == set()


def test_the_timeout_becomes_the_message_time_limit_section_14_3(
    app: Celery, redis_client: redis.Redis
) -> None:
    app.tasks["ml.train"].apply_async(args=[{}], headers={"ext_ml_timeout_seconds": 90})
    [msg] = _messages(redis_client, "ojs.ml.intake")
    assert msg["headers"]["timelimit"] == [90, None]


def test_publishing_an_ml_job_writes_its_message_and_no_class_registry(
    app: Celery, redis_client: redis.Redis
) -> None:
    """The leader reads the job's class from its headers; no registry is kept for it."""
    app.tasks["ml.train"].apply_async(args=[{}])
    [msg] = _messages(redis_client, "ojs.ml.intake")
    assert msg["headers"]["ojs_class"]
    assert app.ojs_ml.store.classes() == {}
    assert not redis_client.keys("ojs:{ml}:class:*")


def test_plain_tasks_keep_their_normal_queue_and_headers(
    app: Celery, redis_client: redis.Redis
) -> None:
    """Invariant 6: tasks without ML attributes behave exactly as without the plugin."""
    app.tasks["plain.add"].apply_async(args=[1, 2])
    [msg] = _messages(redis_client, "celery")
    assert not any(k.startswith(("ext_ml", "ojs_")) for k in msg["headers"])
