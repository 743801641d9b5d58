"""`ext_ml_runtime` (OJS ML Resources §6) and `ext_ml_model_format` (§4) on a live fleet.

Two L4 workers, one advertising vLLM and one llama.cpp (§11 `runtimes`): each job
runs only where its runtime and format can load it ("a vLLM worker cannot load a
GGUF model", §4), and a job no worker can load waits at publish with the reasons.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def _caps(runtime: str) -> str:
    return json.dumps({"gpu": {"type": "nvidia-l4", "count": 1}, "runtimes": [runtime]})


def test_each_job_runs_only_on_the_worker_whose_runtime_loads_its_model_format(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    store = OJSStore(redis_client, prefix="ojs")
    record = app.tasks["ml.record"]
    fleet = [
        WorkerProcess("vllm", redis_url, _caps("vllm"), tmp_path, concurrency=2),
        WorkerProcess("llama", redis_url, _caps("llama.cpp"), tmp_path, concurrency=2),
    ]
    jobs = {
        "gguf-0": {"ext_ml_model_format": "gguf"},
        "gguf-1": {"ext_ml_model_format": "gguf"},
        "safetensors-0": {"ext_ml_model_format": "safetensors"},
        "vllm-0": {"ext_ml_runtime": "vllm"},
    }
    with running(fleet, store):
        for tag, headers in jobs.items():
            record.apply_async(args=[tag], headers=headers)
        tgi = record.apply_async(args=["tgi"], headers={"ext_ml_runtime": "tgi"})
        deadline = time.monotonic() + 60
        while redis_client.llen(RESULTS_KEY) < len(jobs):
            assert time.monotonic() < deadline, fleet[0].output()[-3000:]
            time.sleep(0.1)
        waiting = store.pending()[tgi.id]["reason"]
    ran = {r["tag"]: r["worker"] for r in map(json.loads, redis_client.lrange(RESULTS_KEY, 0, -1))}
    assert ran == {
        "gguf-0": "llama@test",
        "gguf-1": "llama@test",
        "safetensors-0": "vllm@test",
        "vllm-0": "vllm@test",
    }
    assert waiting == (
        "0/2 workers eligible: 1 runtime tgi not in [llama.cpp], 1 runtime tgi not in [vllm]"
    )
    app.close()
