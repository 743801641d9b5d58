"""NVLink islands end to end: a probed worker (fake NVML in the worker process,
4 x A100 bridged in pairs 0-1 and 2-3) reports its free island in the heartbeat, and the
scheduler sends a 2-GPU `nvlink` job only when two free GPUs are peers. Before, with two
free GPUs that were not peers, it was sent, given back and sent again every 0.5 s."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import ROOT, WorkerProcess, running, wait_for_leader

pytestmark = pytest.mark.integration

_SITE = """
import sys
from celery_ojs_ml.testing.fake_nvml import A100_80GB, FakeNVML
sys.modules["pynvml"] = FakeNVML(FakeNVML.of(A100_80GB, 4).devices, nvlink_pairs=[(0, 1), (2, 3)])
"""


def _runs(client: redis.Redis) -> dict[str, dict[str, object]]:
    return {r["tag"]: r for r in map(json.loads, client.lrange(RESULTS_KEY, 0, -1))}


@pytest.mark.timeout(120)
def test_an_nvlink_job_waits_for_a_free_pair_of_peers_and_is_never_given_back(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITE)
    env = {"PYTHONPATH": f"{site}:{ROOT}", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    worker = WorkerProcess("nv", redis_url, "auto", tmp_path, concurrency=4, extra_env=env)
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    with running([worker], store := OJSStore(redis_client, prefix="ojs")):
        wait_for_leader(store)  # jobs sent before the election are placed in one pass
        # three 1-GPU jobs take devices 0, 1 and 2 (best fit keeps the 2-3 pair whole
        # until the third); the one on device 1 ends first, leaving 1 and 3 free
        for tag, secs in (("long-a", 5.0), ("short", 1.0), ("long-b", 5.0)):
            record.apply_async(args=[tag, secs], headers={"ext_ml_gpu_count": 1})
            time.sleep(0.3)
        pair = record.apply_async(
            args=["pair", 0.2],
            headers={"ext_ml_gpu_count": 2, "ext_ml_gpu_interconnect": "nvlink"},
        )
        deadline = time.monotonic() + 60
        while "pair" not in _runs(redis_client) and time.monotonic() < deadline:
            time.sleep(0.1)
    runs = _runs(redis_client)
    assert "pair" in runs, worker.output()[-3000:]
    singles = {tag: runs[tag]["devices"] for tag in ("long-a", "short", "long-b")}
    assert sorted(d for devs in singles.values() for d in devs) == [0, 1, 2], singles
    assert sorted(runs["pair"]["devices"]) in ([0, 1], [2, 3]), runs["pair"]
    assert runs["pair"]["start"] >= min(runs["long-a"]["end"], runs["long-b"]["end"]) - 0.05
    log = worker.output()
    assert f"gave {pair.id} back" not in log, "the scheduler sent it where no pair was free"
    app.close()
