"""`progress(self, step, total, **metrics)` in a real worker: a client polling `AsyncResult`
sees `PROGRESS` with the step the task stopped at, `celery ojs-ml status` and `explain`
show it, `ojs-progress` events go out only when the worker sends task events.

The task stops at a known step until the test sets a Redis key, so what the
test sees does not depend on timing."""

from __future__ import annotations

import json
import time
import types
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from click.testing import CliRunner

from celery_ojs_ml.cli.main import cli
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import HOLD_KEY
from tests.integration.taskapp import APP, make_task_app
from tests.integration.workers import EventLog, WorkerProcess, running

pytestmark = pytest.mark.integration
_DEADLINE_S = 60.0
SENTINEL = "ojs-test-sentinel"


def _wait_for_step(app: Celery, task_id: str, step: int, worker: WorkerProcess) -> Any:
    result = app.AsyncResult(task_id)
    deadline = time.monotonic() + _DEADLINE_S
    while not (result.state == "PROGRESS" and result.info.get("step") == step):
        assert time.monotonic() < deadline, (result.state, result.info, worker.output()[-3000:])
        time.sleep(0.05)
    return result.info


def _release(app: Celery, client: redis.Redis, task_id: str, worker: WorkerProcess) -> Any:
    client.set(HOLD_KEY + task_id, 1)
    result = app.AsyncResult(task_id)
    value = result.get(timeout=_DEADLINE_S)
    assert result.state == "SUCCESS", worker.output()[-3000:]
    return value


def test_a_polling_client_sees_the_step_the_task_reported_then_success(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_task_app(redis_url)
    events_on = {"OJS_TEST_CONF": json.dumps({"worker_send_task_events": True})}
    worker = WorkerProcess(
        "a", redis_url, "profile:nvidia-a100x2", tmp_path, app=APP, concurrency=2,
        extra_env=events_on,
    )  # fmt: skip
    obj = types.SimpleNamespace(app=app)
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        done = lambda events: any(e.get("step") == 5 for e in events)  # noqa: E731
        with EventLog(app, ("ojs-progress",), done) as log:
            task_id = app.tasks["ml.progress_steps"].apply_async(args=[5, 3]).id
            info = _wait_for_step(app, task_id, 3, worker)
            status = CliRunner().invoke(cli, ["status"], obj=obj)
            explained = CliRunner().invoke(cli, ["explain", task_id], obj=obj)
            as_json = CliRunner().invoke(cli, ["explain", task_id, "--json"], obj=obj)
            value = _release(app, redis_client, task_id, worker)
    assert info["total"] == 5 and info["metrics"] == {"loss": 0.3333, "phase": "train"}
    assert isinstance(info["eta_s"], float) and info["eta_s"] >= 0, "a rate after two reports"
    assert status.exit_code == 0, status.output
    assert f"progress  {task_id} step 3/5 (60%), eta" in status.output
    assert explained.exit_code == 0, explained.output
    assert explained.output.startswith(f"{task_id} runs on a@test with GPU(s) ")
    assert "(band on-demand): step 3/5 (60%), eta " in explained.output
    assert "loss=0.3333 phase=train" in explained.output
    assert json.loads(as_json.output)["progress"] == info
    assert value == 5
    steps = [(e["uuid"], e["step"], e["total"]) for e in log.events]
    assert steps == [(task_id, s, 5) for s in range(1, 6)]
    last = log.events[-1]
    assert (last["queue"], last["band"], last["eta_s"]) == ("celery", "on-demand", 0.0)
    assert last["metrics"] == {"loss": 0.2, "phase": "train"}


def test_no_progress_event_goes_out_when_the_worker_sends_no_task_events(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_task_app(redis_url)
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, app=APP)
    done = lambda events: any(e["type"] == SENTINEL for e in events)  # noqa: E731
    store = OJSStore(redis_client, prefix="ojs")
    with running([worker], store), EventLog(app, ("ojs-progress", SENTINEL), done) as log:
        task_id = app.tasks["ml.progress_steps"].apply_async(args=[3, 2]).id
        info = _wait_for_step(app, task_id, 2, worker)
        assert _release(app, redis_client, task_id, worker) == 3
        # Published after the task's events would have been: once the receiver has
        # the sentinel, it has had every event sent before it.
        with app.events.default_dispatcher() as dispatcher:
            dispatcher.send(SENTINEL)
    assert info["step"] == 2 and info["total"] == 3, "the state is stored all the same"
    assert [e["type"] for e in log.events] == [SENTINEL]
