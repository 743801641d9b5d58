"""Priority preemption on a real prefork worker (OJS ML §8, DESIGN decision 5).

Spot jobs fill both GPUs of a worker; a reserved job that needs both arrives.
One spot job checkpoints and yields when asked, the other ignores the flag and
is killed at the end of its grace period. The reserved job starts within the
grace period plus one second; both victims are re-published with the same id,
`retries` unchanged and one preemption counted, and resume from their last
committed checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

GRACE_S = 2
SPOT = {"ext_ml_priority_class": "spot", "ext_ml_preemption_grace_period_s": GRACE_S}


def _runs(client: redis.Redis, task_id: str) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(f"ojs-test:runs:{task_id}", 0, -1)]


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_reserved_job_preempts_spot_jobs_which_resume_from_their_checkpoints(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OJS_TEST_CKPT", str(tmp_path / "ckpt"))
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    worker = WorkerProcess(
        "a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=4,
        extra_env={"OJS_TEST_CKPT": str(tmp_path / "ckpt")},
    )  # fmt: skip
    train = app.tasks["ml.ckpt_train"]
    with running([worker], store):
        polite = train.apply_async(args=[14, 0.3], headers=SPOT).id
        stubborn = train.apply_async(args=[14, 0.3, True], headers=SPOT).id
        _wait(
            lambda: all(
                r and r[-1].get("epoch", -1) >= 1
                for r in (_runs(redis_client, i) for i in (polite, stubborn))
            ),
            20,
            "both spot jobs to be running",
        )
        sent = time.time()
        app.tasks["ml.record"].apply_async(
            args=["reserved", 1.0],
            headers={"ext_ml_priority_class": "reserved", "ext_ml_gpu_count": 2},
        )
        _wait(lambda: redis_client.llen(RESULTS_KEY) >= 1, 20, "the reserved job")
        _wait(
            lambda: all(redis_client.get(f"ojs-test:done:{i}") for i in (polite, stubborn)),
            60,
            "the spot jobs to finish after resuming",
        )
    [reserved] = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert reserved["start"] - sent <= GRACE_S + 1.0, reserved["start"] - sent
    assert sorted(reserved["devices"]) == [0, 1]

    for task_id, how in ((polite, "yielded"), (stubborn, "killed")):
        runs = _runs(redis_client, task_id)
        assert len(runs) == 2, (how, runs)
        first, second = runs
        assert not first.get("done") and second.get("done"), (how, runs)
        assert first["t1"] <= reserved["start"] <= reserved["end"] <= second["t0"], (how, runs)
        assert [r["retries"] for r in runs] == [0, 0], "preemption must not use up retries"
        assert [r["preemptions"] for r in runs] == [0, 1]
        assert second["committed_epoch"] is not None
        assert second["start_epoch"] == second["committed_epoch"] + 1
        assert second["committed_epoch"] >= first.get("epoch", -1)
        assert int(redis_client.get(f"ojs-test:done:{task_id}") or 0) == 1
    log = worker.output()
    assert "did not yield within its grace period" in log
    app.close()
