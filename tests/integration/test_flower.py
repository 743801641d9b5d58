"""A real Flower process shows a worker's OJS ML capabilities and allocations (DESIGN §8).

The plugin's consumer bootstep returns `{"ojs_ml": snapshot}` from `info()`,
which Celery merges into `inspect stats`; Flower polls `stats`, so
`/api/workers?refresh=1` must carry `<worker>.stats.ojs_ml` with the GPU type
and the device a running job holds, and the worker page must show them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import make_app
from tests.integration.workers import ROOT, WorkerProcess

pytestmark = pytest.mark.integration

_POLL_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def flower(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Iterator[str]:
    """`http://127.0.0.1:<port>` of a Flower process on the test broker, API without auth."""
    port = _free_port()
    argv = [sys.executable, "-m", "celery", "-A", "tests.integration.mlapp:app", "flower"]
    argv += [f"--port={port}", "--address=127.0.0.1", "--inspect_timeout=2000"]
    env = {
        **os.environ,
        "OJS_TEST_BROKER": redis_url,
        "PYTHONPATH": str(ROOT),
        "FLOWER_UNAUTHENTICATED_API": "true",
    }
    log = (tmp_path / "flower.log").open("wb")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status), resp.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        return 0, str(exc)


def _poll_ojs_ml(base: str, worker: str, task_id: str) -> dict[str, Any]:
    """Flower's `stats.ojs_ml` of `worker` once it shows `task_id` holding a device."""
    deadline, last = time.monotonic() + _POLL_TIMEOUT_S, "no answer yet"
    while time.monotonic() < deadline:
        status, body = _get(f"{base}/api/workers?refresh=1")
        if status == 200:
            info = json.loads(body).get(worker, {}).get("stats", {}).get("ojs_ml")
            if info and task_id in info["allocator"]["devices"].values():
                return dict(info)
            last = body[:500]
        else:
            last = f"HTTP {status}: {body[:300]}"
        time.sleep(0.5)
    raise AssertionError(f"Flower never showed {task_id} on {worker}; last: {last}")


def test_flower_shows_capabilities_and_which_task_holds_which_gpu(
    redis_url: str, redis_client: redis.Redis, flower: str, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2)
    app = make_app(redis_url)
    try:
        worker.start().wait_live(store)
        long_job = app.tasks["ml.record"].apply_async(args=["long", 120])
        info = _poll_ojs_ml(flower, "a@test", long_job.id)
        status, page = _get(f"{flower}/worker/a@test")
    finally:
        worker.stop(signal.SIGQUIT)  # cold shutdown: do not wait for the 120 s job
        app.close()
    assert info["capabilities"]["gpu"] == {
        "type": "nvidia-a100",
        "count": 2,
        "memory_gb": 80,
        "compute_capability": "8.0",
        "interconnect": "nvlink",
    }
    assert info["labels"]["gpu_type"] == "nvidia-a100"
    [allocation] = info["allocator"]["allocations"]
    assert allocation["task_id"] == long_job.id and len(allocation["devices"]) == 1
    holders = info["allocator"]["devices"]
    assert holders[str(allocation["devices"][0])] == long_job.id
    assert list(holders.values()).count(None) == 1, "the other GPU is free"
    assert info["allocator"]["free"]["gpu_count"] == 1
    assert status == 200 and "nvidia-a100" in page and long_job.id in page
