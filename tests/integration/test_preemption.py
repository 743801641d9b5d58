"""Priority preemption on a real prefork worker (OJS ML §8, DESIGN decision 5).

Spot jobs fill both GPUs of a worker; a reserved job that needs both arrives.
One spot job checkpoints and yields when asked, the other ignores the flag and
is killed at the end of its grace period. The reserved job starts within the
grace period plus one second; both victims are re-published with the same id,
`retries` unchanged and one preemption counted, and resume from their last
committed checkpoint.

The other tests run one 1-GPU worker with short jobs: a job whose
`ext_mlx_scheduling_preemption_policy` is `never` is not preempted, one whose
policy is `immediate` is killed at once (no grace period) and still
re-published as a preemption; past `ojs_ml_max_preemptions` a job is no longer
preemptible; and a preemption is visible as `task-retried` and `ojs-preempted`
events.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import EventLog, WorkerProcess, running

pytestmark = pytest.mark.integration

GRACE_S = 2
SPOT = {"ext_ml_priority_class": "spot", "ext_ml_preemption_grace_period_s": GRACE_S}
RESERVED = {"ext_ml_priority_class": "reserved"}
POLICY = "ext_mlx_scheduling_preemption_policy"
EPOCH_S = 0.25


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
        extra_env={"OJS_TEST_CKPT": str(tmp_path / "ckpt"), "OJS_TEST_MIN_RUNTIME": "0"},
    )  # fmt: skip
    train = app.tasks["ml.ckpt_train"]
    with running([worker], store):
        polite = train.apply_async(args=[14, 0.3], headers=SPOT).id
        stubborn = train.apply_async(
            args=[14, 0.3, True], headers={**SPOT, POLICY: "save_and_retry"}
        ).id  # the policy spelled out: the same cooperative path, grace period and all
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


def _one_gpu_worker(
    redis_url: str, tmp_path: Path, conf: dict[str, Any] | None = None, *extra_args: str
) -> WorkerProcess:
    env = {
        "OJS_TEST_CKPT": str(tmp_path / "ckpt"),
        "OJS_TEST_CONF": json.dumps(conf or {}),
        "OJS_TEST_MIN_RUNTIME": "0",  # these tests preempt young jobs on purpose
    }
    return WorkerProcess(
        "one", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2,
        extra_env=env, extra_args=extra_args,
    )  # fmt: skip


def _results(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(RESULTS_KEY, 0, -1)]


def _running_epoch(client: redis.Redis, task_id: str, run: int, epoch: int) -> bool:
    runs = _runs(client, task_id)
    return len(runs) > run and runs[run].get("epoch", -1) >= epoch


def test_a_job_whose_preemption_policy_is_never_is_not_preempted_by_a_reserved_job(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """OJS ML Extensions §7: `never` keeps a preemptible spot job from being a victim."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    with running([_one_gpu_worker(redis_url, tmp_path)], store):
        spot = (
            app.tasks["ml.ckpt_train"]
            .apply_async(args=[6, EPOCH_S], headers={**SPOT, POLICY: "never"})
            .id
        )
        _wait(lambda: _running_epoch(redis_client, spot, 0, 0), 20, "the spot job to run")
        app.tasks["ml.record"].apply_async(args=["reserved", 0.1], headers=RESERVED)
        _wait(lambda: redis_client.llen(RESULTS_KEY) >= 1, 20, "the reserved job")
    [run] = _runs(redis_client, spot)
    assert run.get("done") and run["preemptions"] == 0
    [reserved] = _results(redis_client)
    assert reserved["start"] >= run["t1"], "the reserved job waited for the GPU"
    app.close()


def test_a_job_whose_preemption_policy_is_immediate_is_killed_at_once_and_resumes(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """OJS ML Extensions §7: `immediate` skips the 30 s grace period; it is still a preemption
    (same id, `retries` unchanged, one more preemption) and resumes from its checkpoint."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    headers = {**SPOT, "ext_ml_preemption_grace_period_s": 30, POLICY: "immediate"}
    worker = _one_gpu_worker(redis_url, tmp_path)
    with running([worker], store):
        spot = app.tasks["ml.ckpt_train"].apply_async(args=[10, EPOCH_S, True], headers=headers).id
        _wait(lambda: _running_epoch(redis_client, spot, 0, 1), 20, "the spot job to checkpoint")
        sent = time.time()
        app.tasks["ml.record"].apply_async(args=["reserved", 0.1], headers=RESERVED)
        _wait(lambda: redis_client.llen(RESULTS_KEY) >= 1, 10, "the reserved job")
        _wait(lambda: redis_client.get(f"ojs-test:done:{spot}"), 20, "the spot job to resume")
    [reserved] = _results(redis_client)
    assert reserved["start"] - sent <= 1.0, reserved["start"] - sent
    first, second = _runs(redis_client, spot)
    assert first["t1"] <= reserved["start"] <= reserved["end"] <= second["t0"]
    assert [first["retries"], second["retries"]] == [0, 0], "preemption must not use up retries"
    assert [first["preemptions"], second["preemptions"]] == [0, 1]
    assert second["start_epoch"] == second["committed_epoch"] + 1
    log = worker.output()
    assert "preempted at once (ext_mlx_scheduling_preemption_policy: immediate)" in log
    assert "did not yield within its grace period" not in log
    app.close()


def test_after_ojs_ml_max_preemptions_a_job_is_no_longer_preemptible(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """`ojs_ml_max_preemptions: 1`: the second reserved job waits for the spot job to end."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    worker = _one_gpu_worker(redis_url, tmp_path, {"ojs_ml_max_preemptions": 1})
    record = app.tasks["ml.record"]
    with running([worker], store):
        spot = app.tasks["ml.ckpt_train"].apply_async(args=[8, EPOCH_S], headers=SPOT).id
        _wait(lambda: _running_epoch(redis_client, spot, 0, 0), 20, "the spot job to run")
        record.apply_async(args=["first", 0.1], headers=RESERVED)
        _wait(lambda: _running_epoch(redis_client, spot, 1, 0), 20, "the spot job to resume")
        record.apply_async(args=["second", 0.1], headers=RESERVED)
        _wait(lambda: redis_client.llen(RESULTS_KEY) >= 2, 20, "both reserved jobs")
    runs = _runs(redis_client, spot)
    assert [r["preemptions"] for r in runs] == [0, 1], "preempted once, then no more"
    assert runs[1].get("done")
    first, second = sorted(_results(redis_client), key=lambda r: r["start"])
    assert first["tag"] == "first" and first["end"] <= runs[1]["t0"]
    assert second["tag"] == "second" and second["start"] >= runs[1]["t1"]
    app.close()


def test_a_preempted_job_is_reported_by_task_retried_and_ojs_preempted_events(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """DESIGN decision 8: Flower sees a retry; `celery ojs-ml status` sees the detail."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    kinds = ("task-retried", "ojs-preempted")
    events = EventLog(app, kinds, lambda seen: {e["type"] for e in seen} >= set(kinds), 15)
    with running([_one_gpu_worker(redis_url, tmp_path, None, "-E")], store), events:
        spot = app.tasks["ml.ckpt_train"].apply_async(args=[4, EPOCH_S], headers=SPOT).id
        _wait(lambda: _running_epoch(redis_client, spot, 0, 0), 20, "the spot job to checkpoint")
        app.tasks["ml.record"].apply_async(args=["reserved", 0.1], headers=RESERVED)
        _wait(lambda: all(events.first(k) for k in kinds), 15, "both events")
    retried, preempted = events.first("task-retried"), events.first("ojs-preempted")
    assert retried is not None and preempted is not None
    assert retried["uuid"] == preempted["uuid"] == spot
    assert retried["exception"] == "Preempted(yielded, preemptions=1)"
    assert preempted["preemptions"] == 1 and preempted["how"] == "yielded"
    assert isinstance(preempted["checkpoint"], int), "the checkpoint it resumes from"
    app.close()
