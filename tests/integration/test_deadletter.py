"""OJS ML §14.2: a checkpointed job that fails for good is dead-lettered with its checkpoint
metadata; `ojs-ml dead` lists it and `ojs-ml dead --retry` resumes it from that checkpoint.
Also `ojs-ml checkpoints TASK_ID`."""

from __future__ import annotations

import json
import time
import types
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from celery_ojs_ml.cli.main import cli
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def test_a_failed_checkpointed_job_is_dead_lettered_and_resumes_on_retry(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"OJS_TEST_CKPT": str(tmp_path / "ckpt")}
    monkeypatch.setenv("OJS_TEST_CKPT", env["OJS_TEST_CKPT"])
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    obj = types.SimpleNamespace(app=app)
    runner = CliRunner()
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, extra_env=env)
    with running([worker], store):
        task_id = app.tasks["ml.flaky_train"].apply_async(args=[5, 3]).id
        deadline = time.monotonic() + 30
        while not json.loads(runner.invoke(cli, ["dead", "--json"], obj=obj).output):
            assert time.monotonic() < deadline, worker.output()[-3000:]
            time.sleep(0.2)
        [dead] = json.loads(runner.invoke(cli, ["dead", "--json"], obj=obj).output)
        listing = runner.invoke(cli, ["checkpoints", task_id], obj=obj)
        retried = runner.invoke(cli, ["dead", "--retry", task_id], obj=obj)
        assert retried.exit_code == 0, retried.output
        deadline = time.monotonic() + 30
        while app.AsyncResult(task_id).state != "SUCCESS":
            assert time.monotonic() < deadline, worker.output()[-3000:]
            time.sleep(0.1)
        assert app.AsyncResult(task_id).result == 5
    assert dead["task_id"] == task_id and "boom at epoch 3" in dead["reason"]
    assert dead["last_checkpoint"]["epoch"] == 2
    assert listing.exit_code == 0 and task_id in listing.output
    assert len([line for line in listing.output.splitlines() if "file://" in line]) == 3
    starts = [int(s) for s in redis_client.lrange(f"ojs-test:flaky:{task_id}", 0, -1)]
    assert starts == [0, 3], "the retried job must resume after its last checkpoint"
    assert json.loads(runner.invoke(cli, ["dead", "--json"], obj=obj).output) == []
    unknown = runner.invoke(cli, ["dead", "--retry", "nope"], obj=obj)
    assert unknown.exit_code != 0 and "not a dead-lettered job" in unknown.output
    app.close()
