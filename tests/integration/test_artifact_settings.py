"""`ojs_ml_artifact_schemes` and `ojs_ml_artifact_prefixes` on the publish paths.

OJS ML Extensions §12.1: artifact URIs MUST use allowed schemes and MUST NOT
allow arbitrary file system access. The app's settings decide what is allowed,
through the router and `ml.submit` on a real (private) Redis, and a refused
job publishes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ojs_ml.errors import ConfigError, SpecError
from celery_ojs_ml.plugin import OJSML
from celery_ojs_ml.wire.settings import read_settings

SHADOW = {"ext_mlx_artifact_model_uri": "file:///etc/shadow"}


def _app(redis_url: str, **conf: Any) -> Celery:
    app = Celery("artifact-test", broker=redis_url, set_as_current=False)
    app.conf.task_create_missing_queues = True
    app.conf.update(conf)
    OJSML(app)

    @app.task(name="ml.train", shared=False, ml={"ext_ml_gpu_count": 1})
    def train() -> None:
        return None

    return app


@pytest.fixture
def app(redis_url: str, redis_client: redis.Redis) -> Iterator[Celery]:
    app = _app(redis_url)
    yield app
    app.close()


def _published(client: redis.Redis) -> list[dict[str, Any]]:
    out = []
    for key in [*client.keys("celery*"), *client.keys("ojs.ml.intake*")]:
        if client.type(key) == b"list":
            out += [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    return out


def test_the_router_refuses_a_file_artifact_uri_and_publishes_nothing_extensions_12_1(
    app: Celery, redis_client: redis.Redis
) -> None:
    """§12.1: backends MUST NOT allow arbitrary file system access."""
    with pytest.raises(SpecError, match="'file:///etc/shadow' is not under an allowed prefix"):
        app.tasks["ml.train"].apply_async(headers=SHADOW)
    assert _published(redis_client) == []


def test_ml_submit_refuses_an_artifact_uri_on_a_loopback_host_extensions_12_1(
    app: Celery, redis_client: redis.Redis
) -> None:
    """§12.1 with OJS ML §15.2: no artifact URI to an internal host unless a prefix allows it."""
    job = {"type": "ml.train", "ext_ml_gpu_count": 1}
    with pytest.raises(SpecError, match=r"points at an internal address '127\.0\.0\.1'"):
        app.ojs_ml.submit({**job, "ext_mlx_training_dataset_uri": "hdfs://127.0.0.1/x"})
    assert _published(redis_client) == []


def test_ojs_ml_artifact_prefixes_lets_the_router_publish_a_file_uri_under_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = _app(redis_url, ojs_ml_artifact_prefixes=["file:///data/artifacts/"])
    uri = "file:///data/artifacts/model.bin"

    app.tasks["ml.train"].apply_async(headers={"ext_mlx_artifact_model_uri": uri})

    [message] = _published(redis_client)
    assert message["headers"]["ext_mlx_artifact_model_uri"] == uri
    app.close()


def test_ojs_ml_artifact_schemes_narrows_the_schemes_ml_submit_accepts_extensions_12_1(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """§12.1: backends MUST validate that artifact URIs use allowed schemes."""
    app = _app(redis_url, ojs_ml_artifact_schemes=["s3"])
    job = {"type": "ml.train", "ext_ml_gpu_count": 1, "ext_mlx_artifact_model_uri": "hf://o/m"}

    with pytest.raises(SpecError, match=r'uses scheme "hf", which is not allowed \(allowed: s3\)'):
        app.ojs_ml.submit(job)
    app.close()


def test_the_artifact_settings_are_read_into_the_bounds() -> None:
    settings = read_settings(
        {"ojs_ml_artifact_schemes": ["s3", "file"], "ojs_ml_artifact_prefixes": ["s3://m/"]}
    )
    bounds = settings.parse_options().bounds
    assert (bounds.artifact_schemes, bounds.artifact_prefixes) == ({"s3", "file"}, ("s3://m/",))


@pytest.mark.parametrize("key", ["ojs_ml_artifact_prefixes", "ojs_ml_checkpoint_prefixes"])
def test_a_prefix_list_given_as_one_string_fails_at_start_with_an_example(key: str) -> None:
    """A bare string would become a tuple of characters and admit every URI."""
    with pytest.raises(ConfigError) as info:
        read_settings({key: "file:///data/artifacts/"})
    assert str(info.value) == (
        f"{key} must be a list, not the string 'file:///data/artifacts/'; "
        f'e.g. app.conf.{key} = ["file:///data/artifacts/"]'
    )
