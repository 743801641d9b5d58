"""A probed worker whose devices differ, on a real worker with the fake NVML in its process
(OJS ML §3.2, §11): a job for the minority model of a mixed host runs on that model's device,
and a job on a MIG host runs on a MIG device named by its UUID in CUDA_VISIBLE_DEVICES.
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
from tests.integration.workers import ROOT, WorkerProcess, running

pytestmark = pytest.mark.integration

_SITE = """
import sys
from celery_ojs_ml.testing import fake_nvml
sys.modules["pynvml"] = fake_nvml.{host}()
"""


def _worker(tmp_path: Path, redis_url: str, host: str) -> WorkerProcess:
    site = tmp_path / f"site-{host}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITE.format(host=host))
    env = {"PYTHONPATH": f"{site}:{ROOT}"}
    return WorkerProcess(host, redis_url, "auto", tmp_path, concurrency=2, extra_env=env)


def _runs(client: redis.Redis, tags: set[str], timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = {r["tag"]: r for r in map(json.loads, client.lrange(RESULTS_KEY, 0, -1))}
        if tags <= set(found):
            return found
        assert time.monotonic() < deadline, f"only {sorted(found)} of {sorted(tags)} ran"
        time.sleep(0.05)


def test_a_minority_model_job_runs_on_that_models_device_of_a_mixed_host_section_3_2(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """NVML order A100, A100, T4, A100: the T4 job gets device 2, the A100 jobs never."""
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    jobs = {
        "t4": {"ext_ml_gpu_type": "nvidia-t4"},
        "a100": {"ext_ml_gpu_type": "nvidia-a100", "ext_ml_gpu_count": 2},
    }
    with running(
        [_worker(tmp_path, redis_url, "mixed_host")], OJSStore(redis_client, prefix="ojs")
    ):
        for tag, headers in jobs.items():
            record.apply_async(args=[tag, 0.2], headers=headers)
        runs = _runs(redis_client, set(jobs))
    app.close()

    assert (runs["t4"]["devices"], runs["t4"]["cvd"]) == ([2], "2")
    assert 2 not in runs["a100"]["devices"] and len(runs["a100"]["devices"]) == 2
    assert "2" not in runs["a100"]["cvd"].split(",")


def test_a_job_on_a_mig_host_sees_its_mig_device_by_uuid_section_3_2(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """GPU 0 in MIG mode (3g.40gb, 1g.10gb, 1g.10gb), GPU 1 whole: a 10 GB job gets a
    1g.10gb slice, as CUDA_VISIBLE_DEVICES=MIG-<uuid>; an 80 GB job gets GPU 1."""
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    jobs = {
        "slice": {"ext_ml_gpu_type": "nvidia-a100", "ext_ml_gpu_memory_gb": 10},
        "whole": {"ext_ml_gpu_type": "nvidia-a100", "ext_ml_gpu_memory_gb": 80},
    }
    with running([_worker(tmp_path, redis_url, "mig_host")], OJSStore(redis_client, prefix="ojs")):
        for tag, headers in jobs.items():
            record.apply_async(args=[tag, 0.2], headers=headers)
        runs = _runs(redis_client, set(jobs))
    app.close()

    assert runs["slice"]["cvd"] in ("MIG-fake-00-01", "MIG-fake-00-03")
    assert (runs["whole"]["devices"], runs["whole"]["cvd"]) == ([3], "1")
