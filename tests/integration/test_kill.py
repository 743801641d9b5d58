"""Kill test (DESIGN decision 4, invariant 5): jobs survive SIGKILLed workers.

Two real prefork workers on a private Redis run checkpointing jobs while the
test SIGKILLs whole workers (main process and pool children, as when a node
dies) at random and restarts them. Leases bring every job back: each one
completes exactly once, never runs on two workers at the same time, and each
re-run starts from the epoch after its last committed checkpoint.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store import OJSStore
from tests.integration.mlapp import make_app
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.integration

JOBS = 20
EPOCHS = 6
KILLS = 30


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        "OJS_TEST_CKPT": str(tmp_path / "ckpt"),
        "OJS_TEST_LEASE_TTL": "2",
        "OJS_TEST_VISIBILITY": "5",
        "OJS_TEST_MAX_CRASHES": "100",
    }


def test_jobs_survive_thirty_random_worker_kills(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _env(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    workers = {
        name: WorkerProcess(
            name, redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2, extra_env=env
        )
        for name in ("a", "b")
    }
    rng = random.Random(1234)
    try:
        for w in workers.values():
            w.start()
        for w in workers.values():
            w.wait_live(store)
        ids = [app.tasks["ml.ckpt_train"].apply_async(args=[EPOCHS, 0.25]).id for _ in range(JOBS)]
        kills = 0
        while kills < KILLS:
            time.sleep(rng.uniform(0.3, 1.2))
            victim = workers[rng.choice(sorted(workers))]
            victim.kill()
            kills += 1
            victim.start()
        _wait_done(redis_client, ids, timeout=150)
    finally:
        for w in workers.values():
            w.stop()
    app.close()
    assert kills >= KILLS

    restarted = 0
    for task_id in ids:
        # Exactly once.
        assert int(redis_client.get(f"ojs-test:done:{task_id}") or 0) == 1, task_id
        runs = [json.loads(r) for r in redis_client.lrange(f"ojs-test:runs:{task_id}", 0, -1)]
        restarted += len(runs) > 1
        # Every (re)run started right after the last committed checkpoint.
        for run in runs:
            expected = 0 if run["committed_epoch"] is None else run["committed_epoch"] + 1
            assert run["start_epoch"] == expected, (task_id, runs)
        # Never on two workers at the same time.
        spans = sorted((r["t0"], r.get("t1", r["t0"])) for r in runs)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, (task_id, runs)
        assert runs[-1].get("done") is True
    assert restarted > 0, "no job was ever interrupted: the kills did not exercise recovery"
    print(f"kills={kills} jobs re-run after a kill={restarted}")


def _wait_done(client: redis.Redis, ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    missing: list[str] = ids
    while time.monotonic() < deadline:
        missing = [i for i in ids if not client.get(f"ojs-test:done:{i}")]
        if not missing:
            return
        time.sleep(0.2)
    details: dict[str, Any] = {
        i: [json.loads(r) for r in client.lrange(f"ojs-test:runs:{i}", 0, -1)] for i in missing
    }
    raise AssertionError(f"{len(missing)} jobs never completed: {details}")
