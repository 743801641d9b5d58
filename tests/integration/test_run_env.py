"""A Flux jobspec's `attributes.system.cwd` and `environment` on a real worker (Flux RFC 25
§Attributes): the pool child runs the task there with those variables, and the next task
in the same child sees neither; a directory the worker lacks fails the job with the reason.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.runapp import APP, make_run_app, reports
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

CAPS = '{"accelerator": "cpu", "cpu_cores": 2, "memory_gb": 8}'


def jobspec(tag: str, system: dict[str, Any]) -> dict[str, Any]:
    """A one-slot, one-core jobspec running `run.report <tag>`."""
    slot = {"type": "slot", "count": 1, "label": "default", "with": [{"type": "core", "count": 1}]}
    task = {"command": ["run.report", tag], "slot": "default", "count": {"per_slot": 1}}
    return {
        "version": 1,
        "resources": [slot],
        "tasks": [task],
        "attributes": {"system": {"duration": 60, **system}},
    }


def _report(client: redis.Redis, tag: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [e for e in reports(client) if e["tag"] == tag]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"{tag} never reported"
        time.sleep(0.05)


def test_a_jobspec_cwd_and_environment_apply_to_its_run_only_flux_rfc25_attributes(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_run_app(redis_url)
    workdir = tmp_path / "run-dir"
    workdir.mkdir()
    worker = WorkerProcess("env", redis_url, CAPS, tmp_path, concurrency=1, app=APP)
    with running([worker], store):
        group = app.ojs_ml.submit(
            jobspec("flux", {"cwd": str(workdir), "environment": {"FOO": "bar", "N": 4}})
        )
        group.get(timeout=60)
        during = _report(redis_client, "flux")
        app.tasks["run.report"].apply_async(args=["next"]).get(timeout=60)
        after = _report(redis_client, "next")
    app.close()

    assert (during["cwd"], during["foo"]) == (str(workdir), "bar")
    assert after["pid"] == during["pid"]  # the same pool child ran both
    assert after["foo"] is None
    assert after["cwd"] != str(workdir)


def test_a_jobspec_whose_cwd_is_missing_on_the_worker_fails_with_the_reason_flux_rfc25(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The gate refuses it (its result a failure naming attributes.system.cwd); the worker
    goes on serving."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_run_app(redis_url)
    missing = tmp_path / "never-made"
    worker = WorkerProcess("nodir", redis_url, CAPS, tmp_path, concurrency=1, app=APP)
    with running([worker], store):
        group = app.ojs_ml.submit(jobspec("lost", {"cwd": str(missing)}))
        with pytest.raises(Exception, match=r"attributes\.system\.cwd") as failed:
            group.get(timeout=60)
        app.ojs_ml.submit(jobspec("later", {"cwd": str(tmp_path)})).get(timeout=60)
        later = _report(redis_client, "later")
    app.close()

    assert "is not a directory on this worker" in str(failed.value)
    assert later["cwd"] == str(tmp_path)
    assert not any(e["tag"] == "lost" for e in reports(redis_client))
