"""A batch's callbacks on a real worker (OJS Workflow Primitives §6.4, §6.5, §7.4): the batch
runs as a chord, `on_success` and `on_complete` run once with every job's result, and a
failed job fires `on_failure` (and `on_complete`) instead, with every job's result too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.runapp import APP, ITEM_FAIL, make_run_app, reports
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

CAPS = '{"accelerator": "cpu", "cpu_cores": 4, "memory_gb": 8}'
ML = {"ext_ml_cpu_cores": 1}


def batch(values: list[str], callbacks: dict[str, Any]) -> dict[str, Any]:
    jobs = [{"type": "wf.item", "args": [v], **ML} for v in values]
    return {"workflow_type": "batch", "id": "wf-1", "jobs": jobs, "callbacks": callbacks}


def _callbacks(client: redis.Redis, count: int, timeout_s: float = 60) -> list[dict[str, Any]]:
    """The callback records once `count` are in, after a pause in which no more may come."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [e for e in reports(client) if e["tag"] in ("collect", "alert")]
        if len(found) >= count:
            time.sleep(2.0)  # a second firing would arrive in this pause
            return [e for e in reports(client) if e["tag"] in ("collect", "alert")]
        assert time.monotonic() < deadline, f"callbacks so far: {found}"
        time.sleep(0.05)


def test_a_batch_runs_its_success_callback_once_with_all_results_ojs_workflows_6_4(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_run_app(redis_url)
    worker = WorkerProcess("wf", redis_url, CAPS, tmp_path, concurrency=3, app=APP)
    doc = batch(
        ["a", "b", "c"],
        {
            "on_success": {"type": "wf.collect", "args": ["success"]},
            "on_failure": {"type": "wf.alert", "args": ["failure"]},
        },
    )
    with running([worker], store):
        sent = app.ojs_ml.submit(doc).get(timeout=60)
        fired = _callbacks(redis_client, 1)
        success = app.AsyncResult(sent["on_success"]).get(timeout=60)
    app.close()

    assert [(e["tag"], e["label"], e["results"]) for e in fired] == [
        ("collect", "success", ["A", "B", "C"])
    ]
    assert set(sent) == {"on_success"}
    assert success == ["A", "B", "C"]


def test_a_failed_job_fires_on_failure_and_on_complete_not_on_success_ojs_workflows_6_5(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """§6.5: any job failed: on_complete and on_failure fire, on_success does not; §7.4:
    they get every job's result, the failed one's as its error."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_run_app(redis_url)
    worker = WorkerProcess("wf", redis_url, CAPS, tmp_path, concurrency=3, app=APP)
    doc = batch(
        ["a", ITEM_FAIL, "c"],
        {
            "on_complete": {"type": "wf.collect", "args": ["complete"]},
            "on_success": {"type": "wf.collect", "args": ["success"]},
            "on_failure": {"type": "wf.alert", "args": ["failure"], **ML},
        },
    )
    with running([worker], store):
        result = app.ojs_ml.submit(doc)
        fired = _callbacks(redis_client, 2)
        with pytest.raises(Exception, match="this batch job fails"):
            result.get(timeout=60)  # the chord's own result is the failure
    app.close()

    error = {"error": "RuntimeError: this batch job fails"}
    assert sorted((e["tag"], e["label"]) for e in fired) == [
        ("alert", "failure"),
        ("collect", "complete"),
    ]
    assert all(e["results"] == ["A", error, "C"] for e in fired)
