"""TPU jobs on a real worker with simulated TPU capabilities see exactly their chips
(OJS ML §3.3), and the pool child clears the selection after each task.

The worker declares the 16-chip v5e slice of `examples/workers/tpu-v5e-4x4.json`.
Three TPU jobs (4, 4 and a 2x4 slice of 8 chips) run at once; each task reports the
variables libtpu reads, then holds until the test releases it. Plain tasks then
run in the same three pool children and must see none of them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.accelapp import APP, ENV_KEY, make_accel_app
from tests.integration.mlapp import HOLD_KEY
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

CAPS = "examples/workers/tpu-v5e-4x4.json"
JOBS = {
    "four-a": {"ext_ml_tpu_type": "v5e", "ext_ml_tpu_chip_count": 4},
    "four-b": {"ext_ml_tpu_type": "v5e", "ext_ml_tpu_chip_count": 4},
    "slice-2x4": {"ext_ml_tpu_type": "v5e", "ext_ml_tpu_topology": "2x4"},
}
TPU_NAMES = (
    "TPU_VISIBLE_CHIPS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_PROCESS_BOUNDS",
    "TPU_PROCESS_ADDRESSES",
    "TPU_PROCESS_PORT",
)


def _reports(client: redis.Redis, tags: set[str], timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = {e["tag"]: e for e in map(json.loads, client.lrange(ENV_KEY, 0, -1))}
        if tags <= set(found):
            return {t: found[t] for t in tags}
        assert time.monotonic() < deadline, f"only {sorted(found)} of {sorted(tags)} reported"
        time.sleep(0.05)


def _release(client: redis.Redis, tags: set[str]) -> None:
    for tag in tags:
        client.set(HOLD_KEY + tag, 1)


def test_concurrent_tpu_jobs_each_see_only_their_own_chips_and_children_are_cleared_after(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """§3.3 on a real worker: disjoint chips, the bounds of each sub-slice, one process,
    a port of its own; and after the task the pool child's environment is as before."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_accel_app(redis_url)
    env_task = app.tasks["accel.env"]
    worker = WorkerProcess("tpu", redis_url, CAPS, tmp_path, concurrency=3, app=APP)
    with running([worker], store):
        jobs = {t: env_task.apply_async(args=[t], headers=ml) for t, ml in JOBS.items()}
        during = _reports(redis_client, set(JOBS))
        _release(redis_client, set(JOBS))
        for result in jobs.values():
            result.get(timeout=60)
        plain = {f"plain-{i}" for i in range(3)}
        after = [env_task.apply_async(args=[t]) for t in sorted(plain)]
        cleared = _reports(redis_client, plain)  # all three held: one in each child
        _release(redis_client, plain)
        for result in after:
            result.get(timeout=60)
    app.close()

    chips = {t: during[t]["chips"] for t in JOBS}
    assert sorted(c for cs in chips.values() for c in cs) == list(range(16)), chips
    for tag, want, bounds in (("four-a", 4, "2,2,1"), ("four-b", 4, "2,2,1"),
                              ("slice-2x4", 8, "2,4,1")):  # fmt: skip
        env, mine = during[tag]["env"], chips[tag]
        port = str(8476 + min(mine))
        assert len(mine) == want
        assert env == {
            "TPU_VISIBLE_CHIPS": ",".join(str(c) for c in mine),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds,
            "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
            "TPU_PROCESS_PORT": port,
            "CUDA_VISIBLE_DEVICES": "",  # a TPU job is pinned to no GPU
        }
    assert {r["pid"] for r in cleared.values()} == {r["pid"] for r in during.values()}
    for report in cleared.values():
        assert report["chips"] is None
        assert {n: report["env"][n] for n in TPU_NAMES} == dict.fromkeys(TPU_NAMES)
