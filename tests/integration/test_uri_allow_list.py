"""Checkpoint and artifact URIs that reach the file system are refused on every path
(OJS ML Extensions §12.1: artifact URIs MUST NOT allow arbitrary file system access;
OJS ML §15.3: checkpoint storage URIs MUST be validated against an allow-list).

The router refuses them at publish; a message written by a foreign producer (no
router) is refused by the worker's gate with the reason, dead-lettered and failed,
while the worker carries on; and the task-side checkpoint helper refuses to write
where its message says when that message bypassed the gate.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.classes import class_id
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.store.deadletter import dead_jobs
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.queues import ml_queue, worker_queue_name
from tests.integration.accelapp import APP, make_accel_app
from tests.integration.test_fleet import _wait
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

NAME = "uris"
HOST = f"{NAME}@test"
CID = class_id(normalize({"ext_ml_gpu_count": 1}).requirements)
CKPT_FIX = "app.conf.ojs_ml_checkpoint_prefixes"


@pytest.fixture
def apps(redis_url: str, redis_client: redis.Redis) -> Iterator[tuple[Celery, Celery]]:
    app = make_accel_app(redis_url)
    foreign = Celery("foreign", broker=redis_url, backend=redis_url, set_as_current=False)
    yield app, foreign
    app.close()
    foreign.close()


def _outside(app: Celery, uri: str) -> str:
    """The refusal of a checkpoint storage URI outside the test app's granted prefixes."""
    granted = list(app.ojs_ml.parse_options.bounds.checkpoint_prefixes)
    return (
        f"ext_ml_checkpoint_storage_uri {uri!r} is outside the allowed prefixes {granted} "
        f"(OJS ML §15.3, Extensions §12.1); use a URI under one of {granted}, or add its "
        f"prefix to {CKPT_FIX}"
    )


def _dead_reason(store: OJSStore, task_id: str) -> str | None:
    return next((d["reason"] for d in dead_jobs(store) if d["task_id"] == task_id), None)


def _send_to_gate(foreign: Celery, task_id: str, headers: dict[str, Any]) -> None:
    """A raw message, as a producer without the plugin writes it, to the worker's own queue."""
    queue = ml_queue(worker_queue_name("ojs", HOST))
    foreign.send_task(
        "accel.env",
        args=[task_id],
        kwargs={"limit_s": 0.0},
        task_id=task_id,
        headers={h.CLASS: CID, "ext_ml_gpu_count": 1, **headers},
        queue=queue,
    )


def test_the_router_refuses_a_file_checkpoint_uri_at_publish_section_15_3(
    apps: tuple[Celery, Celery],
) -> None:
    app, _ = apps
    with pytest.raises(SpecError) as found:
        app.tasks["accel.ckpt_save"].apply_async(
            headers={"ext_ml_gpu_count": 1, "ext_ml_checkpoint_storage_uri": "file:///etc/cron.d/"}
        )
    assert str(found.value) == _outside(app, "file:///etc/cron.d/")


def test_a_raw_message_with_a_file_checkpoint_uri_is_refused_at_the_gate_with_the_reason_12_1(
    apps: tuple[Celery, Celery], redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Extensions §12.1 / §15.3 on the worker: the gate re-checks what no router checked.
    The job is dead-lettered and failed with the reason; nothing is lost, the worker
    goes on (the valid job after it runs), and an `ext_mlx_*` URI is re-checked too."""
    app, foreign = apps
    store = OJSStore(redis_client, prefix="ojs")
    worker = WorkerProcess(NAME, foreign.conf.broker_url, "profile:nvidia-l4x1", tmp_path, app=APP)
    ckpt, shadow = f"ckpt-{uuid.uuid4().hex[:8]}", f"mlx-{uuid.uuid4().hex[:8]}"
    with running([worker], store):
        _send_to_gate(foreign, ckpt, {"ext_ml_checkpoint_storage_uri": "file:///etc/cron.d/"})
        _send_to_gate(foreign, shadow, {"ext_mlx_artifact_model_uri": "file:///etc/shadow"})
        reasons = _wait(
            lambda: (
                all(_dead_reason(store, t) for t in (ckpt, shadow))
                and {t: _dead_reason(store, t) for t in (ckpt, shadow)}
            ),
            60,
            "both raw messages to be refused",
        )
        valid = app.tasks["accel.env"].apply_async(
            args=["valid"], kwargs={"limit_s": 0.0}, headers={"ext_ml_gpu_count": 1}
        )
        assert valid.get(timeout=60)["tag"] == "valid"
        failed = foreign.AsyncResult(ckpt)
        assert failed.state == "FAILURE"
    assert reasons[ckpt] == (
        f"refused by {HOST}: invalid requirements: {_outside(app, 'file:///etc/cron.d/')}"
    )
    assert reasons[shadow].startswith(
        f"refused by {HOST}: invalid ext_mlx_* attributes: ext_mlx_artifact_model_uri "
        "'file:///etc/shadow' is not under an allowed prefix (OJS ML Extensions §12.1)"
    )
    assert "ext_ml_checkpoint_storage_uri" in str(failed.result)
    assert "Traceback" not in worker.output()


def test_the_checkpoint_helper_refuses_to_save_where_a_message_that_skipped_the_gate_says_12_1(
    apps: tuple[Celery, Celery], redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A plain message (no `ojs_class`: the gate lets it through as plain Celery) cannot
    make the helper write outside the granted prefixes: the save raises, naming the
    attribute and the setting, and nothing is written."""
    app, foreign = apps
    store = OJSStore(redis_client, prefix="ojs")
    target = Path(f"/var/tmp/ojs-denied-{uuid.uuid4().hex[:8]}")
    worker = WorkerProcess(NAME, foreign.conf.broker_url, "profile:nvidia-l4x1", tmp_path, app=APP)
    with running([worker], store):
        result = foreign.send_task(
            "accel.ckpt_save", headers={"ext_ml_checkpoint_storage_uri": f"file://{target}/"}
        )
        with pytest.raises(Exception) as found:
            result.get(timeout=60)
    assert type(found.value).__name__ == "SpecError"
    assert str(found.value) == _outside(app, f"file://{target}/")
    assert not target.exists()
