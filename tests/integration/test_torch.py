"""Real training survives a crash: a PyTorch CPU loop is SIGKILLed mid-run, resumes on the
other worker from its last committed checkpoint, and ends with weights bit-for-bit equal
to an uninterrupted run (needs the `[torch]` extra, torch==2.13.0)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import make_app
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.integration
torchjob = pytest.importorskip(
    "tests.integration.torchjob", reason="install the [torch] extra: pip install torch==2.13.0"
)
EPOCHS = 8


def test_a_killed_torch_training_resumes_elsewhere_with_bit_identical_weights(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"OJS_TEST_CKPT": str(tmp_path / "ckpt"), "OJS_TEST_LEASE_TTL": "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    a = WorkerProcess(
        "a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=1, extra_env=env
    )
    b = WorkerProcess(
        "b", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=1, extra_env=env
    )
    try:
        a.start().wait_live(store)
        task_id = app.tasks["ml.torch_train"].apply_async(args=[EPOCHS, 0.3]).id
        deadline = time.monotonic() + 60
        while int(redis_client.get(f"ojs-test:torch-epoch:{task_id}") or -1) < 2:
            assert time.monotonic() < deadline, a.output()[-3000:]
            time.sleep(0.05)
        # Kill first, then start the survivor: started earlier, a slow start-up on a
        # loaded machine could let `a` finish all epochs before the kill.
        a.kill()
        b.start().wait_live(store)
        deadline = time.monotonic() + 90
        while not redis_client.get(f"ojs-test:torch-weights:{task_id}"):
            assert time.monotonic() < deadline, b.output()[-3000:]
            time.sleep(0.1)
    finally:
        a.stop()
        b.stop()
    app.close()
    runs = [json.loads(r) for r in redis_client.lrange(f"ojs-test:torch-runs:{task_id}", 0, -1)]
    assert [r["worker"] for r in runs] == ["a@test", "b@test"], runs
    assert runs[1]["start"] >= 3, "the resumed run must start after the committed epochs"
    got = bytes.fromhex(redis_client.get(f"ojs-test:torch-weights:{task_id}").decode())
    assert got == torchjob.reference(EPOCHS)
    assert got != torchjob.reference(EPOCHS - 1), "the comparison must tell runs apart"
