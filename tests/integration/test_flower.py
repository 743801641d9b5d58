"""A real Flower process shows a worker's OJS ML state and a job's devices (DESIGN §8).

The plugin's consumer bootstep returns flat `ojs_ml.*` pairs from `info()`, which
Celery merges into `inspect stats`; Flower polls `stats`, so `/api/workers?refresh=1`
carries them and the worker page shows one readable row per pair (tab "Other"). An
ML job's `task-started` event carries its band and devices, which Flower's task page
and `/api/task/info` show with the `flowerconfig.py` of docs/operations.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.helpers import free_port
from tests.integration.mlapp import make_app
from tests.integration.workers import ROOT, WorkerProcess

pytestmark = pytest.mark.integration

_POLL_TIMEOUT_S = 60.0
WORKER = "a@test"


def flowerconfig_from_docs() -> str:
    """The `flowerconfig.py` docs/operations.md gives, run as it is written there."""
    text = (ROOT / "docs" / "operations.md").read_text()
    found = re.search(r"```python\n(# flowerconfig\.py.*?)```", text, re.S)
    assert found, "docs/operations.md lost its flowerconfig.py block"
    return found.group(1)


def start_flower(redis_url: str, tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A Flower process on the test broker (API without auth, the documented config)."""
    port, conf = free_port(), tmp_path / "flowerconfig.py"
    conf.write_text(flowerconfig_from_docs())
    argv = [sys.executable, "-m", "celery", "-A", "tests.integration.mlapp:app", "flower"]
    argv += [f"--port={port}", "--address=127.0.0.1", "--inspect_timeout=2000"]
    argv += [f"--conf={conf}"]
    env = {
        **os.environ,
        "OJS_TEST_BROKER": redis_url,
        "PYTHONPATH": str(ROOT),
        "FLOWER_UNAUTHENTICATED_API": "true",
    }
    log = (tmp_path / "flower.log").open("wb")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, f"http://127.0.0.1:{port}"


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), str(exc)
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        return 0, str(exc)


def poll_json(url: str, done: Callable[[Any], bool], what: str) -> Any:
    """GET `url` until its JSON body satisfies `done`."""
    deadline, last = time.monotonic() + _POLL_TIMEOUT_S, "no answer yet"
    while time.monotonic() < deadline:
        status, body = _get(url)
        if status == 200:
            found = json.loads(body)
            if done(found):
                return found
            last = body[:800]
        else:
            last = f"HTTP {status}: {body[:300]}"
        time.sleep(0.5)
    raise AssertionError(f"{what} never showed at {url}; last: {last}")


@dataclass
class Scene:
    flower: str
    job_id: str
    plain_id: str
    stats: dict[str, Any]
    page: str


@pytest.fixture(scope="module")
def scene(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    """Flower, and a worker (`-E`) running a 120 s ML job after a plain task."""
    tmp_path = tmp_path_factory.mktemp("flower")
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    flower, base = start_flower(redis_url, tmp_path)
    worker = WorkerProcess(
        "a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2, extra_args=("-E",)
    )
    app = make_app(redis_url)
    try:
        worker.start().wait_live(OJSStore(client, prefix="ojs"))
        # Flower's event receiver is connected once it has heard the worker's heartbeat:
        # a task event sent before that would never reach it.
        poll_json(f"{base}/api/workers?status=1", lambda w: w.get(WORKER) is True, "heartbeat")
        plain = app.tasks["plain.add"].apply_async(args=[2, 3])
        assert plain.get(timeout=_POLL_TIMEOUT_S)["sum"] == 5
        job = app.tasks["ml.record"].apply_async(args=["long", 120])
        workers = poll_json(
            f"{base}/api/workers?refresh=1",
            lambda w: (
                job.id in str(w.get(WORKER, {}).get("stats", {}).get("ojs_ml.devices"))
                and w[WORKER]["stats"].get("ojs_ml.leader") is True
            ),
            f"{job.id} on {WORKER}, which leads",
        )
        status, page = _get(f"{base}/worker/{WORKER}")
        assert status == 200, page
        yield Scene(base, job.id, plain.id, workers[WORKER]["stats"], page)
    finally:
        worker.stop(signal.SIGQUIT)  # cold shutdown: do not wait for the 120 s job
        app.close()
        flower.send_signal(signal.SIGTERM)
        try:
            flower.wait(timeout=10)
        except subprocess.TimeoutExpired:
            flower.kill()
            flower.wait()


def test_flowers_api_shows_the_plugin_stats_as_flat_pairs_of_scalars(scene: Scene) -> None:
    mine = {k: v for k, v in scene.stats.items() if k.startswith("ojs_ml")}
    assert "ojs_ml" not in mine, "the nested document is ojs_ml_status's, not stats'"
    assert all(isinstance(v, str | int | float | bool) for v in mine.values()), mine
    assert mine["ojs_ml.gpus"] == "1/2 free (nvidia-a100 80 GB, nvlink)"
    assert mine["ojs_ml.devices"] in (f"0: {scene.job_id}; free: 1", f"1: {scene.job_id}; free: 0")
    assert mine["ojs_ml.running"] == 1 and mine["ojs_ml.held"] == 0
    assert mine["ojs_ml.leader"] is True, "the only candidate leads the fleet scheduler"
    assert mine["ojs_ml.pinning"] == "CUDA_VISIBLE_DEVICES per task"
    assert mine["ojs_ml.queues"] == f"ojs.ml.w.{WORKER}"
    assert mine["ojs_ml.processes"] == 2
    assert "gpu_type=nvidia-a100" in mine["ojs_ml.labels"]


def test_flowers_worker_page_shows_readable_rows_and_no_raw_dict(scene: Scene) -> None:
    page = scene.page
    assert "<td>ojs_ml.gpus</td>" in page
    assert "1/2 free (nvidia-a100 80 GB, nvlink)" in page
    assert scene.job_id in page
    assert "{&#39;" not in page and "{'capabilities'" not in page, "a raw dict repr"


def test_flowers_task_page_shows_an_ml_jobs_band_and_devices(scene: Scene) -> None:
    """With the documented flowerconfig.py: the fields `task-started` carries."""
    info = poll_json(
        f"{scene.flower}/api/task/info/{scene.job_id}",
        lambda t: t.get("ojs_devices") is not None,
        "the job's devices",
    )
    device = scene.stats["ojs_ml.devices"].split(f": {scene.job_id}")[0]
    assert info["ojs_band"] == "on-demand" and info["ojs_devices"] == device
    assert info["state"] == "STARTED" and info["worker"] == WORKER
    status, page = _get(f"{scene.flower}/task/{scene.job_id}")
    assert status == 200 and "Ojs band" in page and "on-demand" in page
    assert re.search(rf"Ojs devices</dt>\s*<dd>\s*{device}\s*</dd>", page), page[-3000:]


def test_a_plain_tasks_events_carry_no_ojs_fields(scene: Scene) -> None:
    """DESIGN invariant 6: a task without ML attributes is plain Celery's."""
    info = poll_json(
        f"{scene.flower}/api/task/info/{scene.plain_id}",
        lambda t: t.get("state") == "SUCCESS",
        "the plain task's success",
    )
    assert info["ojs_band"] is None and info["ojs_devices"] is None
