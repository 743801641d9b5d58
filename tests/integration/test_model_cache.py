"""The per-child model cache (`ml.model`) on a real prefork worker with warm
children: a model is loaded once per child and reused, and the worker's `models_loaded`
(§11) shows it within a heartbeat."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def _results(client: redis.Redis, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while client.llen(RESULTS_KEY) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return [json.loads(raw) for raw in client.lrange(RESULTS_KEY, 0, -1)]


def test_a_model_loaded_once_is_reused_and_models_loaded_shows_it_within_a_heartbeat(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2,
                           extra_env={"OJS_TEST_RECYCLE": "warm"})  # fmt: skip
    with running([worker], store):
        before = (
            store.live_workers()["a@test"]["capabilities"]["capabilities"].get("models_loaded")
        ) or []
        results = [app.tasks["ml.infer"].apply_async(args=[i]) for i in range(16)]
        records = _results(redis_client, 16)
        done = time.monotonic()
        seen: list[Any] = []
        while time.monotonic() - done < 2.0:  # the heartbeat is 0.5 s in tests
            seen = (
                store.live_workers()["a@test"]["capabilities"]["capabilities"].get("models_loaded")
                or []
            )
            if seen:
                break
            time.sleep(0.05)
        assert [r.get(timeout=10)["y"] for r in results] == [2 * i for i in range(16)]
    assert before == []
    assert seen == [{"model_id": "m", "model_version": "1"}], seen
    loads = [r for r in records if r["loaded"]]
    assert 1 <= len(loads) <= 2, f"{len(loads)} loads for 16 requests on 2 children"
    assert all(r["net_pid"] == r["pid"] for r in records), "a model crossed processes"
    assert all(r["first_cvd"] == r["cvd"] for r in records), "CUDA bound to other devices"
    app.close()


def test_a_checksum_mismatch_fails_the_job_with_the_named_error(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """§4 MUST: a mismatch rejects the job, naming ext_ml_model_checksum and both digests."""
    import hashlib

    weights = tmp_path / "model.bin"
    weights.write_bytes(b"weights" * 100)
    good = "sha256:" + hashlib.sha256(weights.read_bytes()).hexdigest()
    bad = "sha256:" + "0" * 64
    app = make_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2)
    task = app.tasks["ml.verified_load"]
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        ok = task.apply_async(args=[str(weights)], headers={"ext_ml_model_checksum": good})
        wrong = task.apply_async(args=[str(weights)], headers={"ext_ml_model_checksum": bad})
        assert ok.get(timeout=30) == 700
        with pytest.raises(Exception) as failed:
            wrong.get(timeout=30)
    text = str(failed.value)
    assert type(failed.value).__name__ == "ChecksumMismatch", repr(failed.value)
    assert "ext_ml_model_checksum" in text and bad in text and good in text
    app.close()


def test_a_pinned_version_runs_only_where_it_is_loaded_by_default_section_4(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """§4 MUST, by default (`ojs_ml_model_registry_access` off): a job pinned to m@1 runs on
    the worker that declares m@1 loaded; a job pinned to m@2 never runs there."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    caps = {
        "gpu": {"type": "nvidia-a100", "count": 2},
        "models_loaded": [{"model_id": "m", "model_version": "1"}],
    }
    env = {"OJS_TEST_RECYCLE": "warm",
           "OJS_TEST_CONF": json.dumps({"ojs_ml_model_registry_access": False})}  # fmt: skip
    worker = WorkerProcess("a", redis_url, json.dumps(caps), tmp_path, concurrency=2,
                           extra_env=env)  # fmt: skip
    with running([worker], store):
        advertised = store.live_workers()["a@test"]["capabilities"]["capabilities"]
        other = app.tasks["ml.infer"].apply_async(args=[7], headers={"ext_ml_model_version": "2"})
        pinned = app.tasks["ml.infer"].apply_async(args=[1])
        assert pinned.get(timeout=30)["y"] == 2
        time.sleep(2.0)  # four heartbeats and many scheduling passes
        ran = [json.loads(r)["task_id"] for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert "model_registry_access" not in advertised  # false: left out of the advertisement
    assert pinned.id in ran and other.id not in ran, ran
    assert other.state == "PENDING"
    app.close()


def test_version_pinning_holds_by_default_section_4() -> None:
    """Nothing configured: a worker does not claim it can fetch every model version."""
    from celery_ojs_ml.capabilities import Capabilities
    from celery_ojs_ml.wire.settings import OJSMLSettings

    assert OJSMLSettings().model_registry_access is False
    assert Capabilities.model_validate({"gpu": {"count": 1}}).model_registry_access is False
