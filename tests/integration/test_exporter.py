"""`celery ojs-ml metrics` against a real worker: what a Prometheus scrape of `/metrics` shows.

The exporter runs as its own process (the CLI verb), the worker with task events
(`-E`), and the jobs hold their GPUs until the test releases them, so what a scrape
sees does not depend on timing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from celery_ojs_ml.exporter import metric_names
from celery_ojs_ml.spec.classes import BANDS
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.registry import OJSStore
from tests.helpers import free_port, stop_process
from tests.integration.mlapp import HOLD_KEY, RESULTS_KEY, make_app
from tests.integration.workers import ROOT, WorkerProcess, running

pytestmark = pytest.mark.integration

_DEADLINE_S = 60.0
_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Samples = list[tuple[str, dict[str, str], float]]


def _scrape(url: str) -> tuple[str, Samples]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
    samples: Samples = []
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found and not line.startswith("#"):
            labels = dict(_LABEL.findall(found.group(2) or ""))
            samples.append((found.group(1), labels, float(found.group(3))))
    return text, samples


def _sum(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())


@pytest.fixture
def exporter(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Iterator[str]:
    """The `metrics` verb serving on a free port; its URL once its event receiver listens."""
    port = free_port()
    env = {**os.environ, "OJS_TEST_BROKER": redis_url, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "celery", "-A", "tests.integration.mlapp:app", "ojs-ml",
            "metrics", "--port", str(port), "--address", "127.0.0.1"]  # fmt: skip
    log = tmp_path / "exporter.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        # Nothing else subscribes yet: a pattern subscription is the receiver's binding.
        _until(lambda: _answers(url) and int(redis_client.pubsub_numpat()) > 0, log, proc)
        yield url
    finally:
        stop_process(proc)


def _answers(url: str) -> bool:
    try:
        _scrape(url)
    except OSError:
        return False
    return True


def _until(ready: Callable[[], bool], log: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _DEADLINE_S
    while not ready():
        assert proc.poll() is None, f"the exporter exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the exporter never listened:\n{log.read_text()}"
        time.sleep(0.1)


def _poll(url: str, holds: Callable[[Samples], bool], what: str) -> tuple[str, Samples]:
    deadline = time.monotonic() + _DEADLINE_S
    while True:
        text, samples = _scrape(url)
        if holds(samples):
            return text, samples
        assert time.monotonic() < deadline, f"{what}; last scrape:\n{text}"
        time.sleep(0.2)


def test_a_scrape_shows_a_full_worker_its_running_and_waiting_jobs_then_their_waits(
    exporter: str, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Two 2-GPU jobs fill a 4-GPU worker while two more wait; after all ran, every start
    was observed in the wait-time histogram, and no label names a task."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    worker = WorkerProcess(
        "four", redis_url, "profile:nvidia-a100x4", tmp_path, concurrency=4, extra_args=("-E",)
    )
    hold = app.tasks["ml.hold"]
    with running([worker], store):
        ids = [
            hold.apply_async(args=[f"h{i}", 120.0], headers={"ext_ml_gpu_count": 2}).id
            for i in range(4)
        ]

        def full(s: Samples) -> bool:
            gpus = (_sum(s, "ojs_ml_gpus", state="allocated"), _sum(s, "ojs_ml_gpus", state="free"))
            jobs = (
                _sum(s, "ojs_ml_jobs", state="running"),
                _sum(s, "ojs_ml_jobs", state="pending"),
            )
            return gpus == (4, 0) and jobs == (2, 2)

        text, busy = _poll(exporter, full, "never 4 GPUs allocated, 2 jobs running, 2 waiting")
        for i in range(4):
            redis_client.set(HOLD_KEY + f"h{i}", 1)
        deadline = time.monotonic() + _DEADLINE_S
        while redis_client.llen(RESULTS_KEY) < 4:
            assert time.monotonic() < deadline, worker.output()[-3000:]
            time.sleep(0.1)
        waited = "ojs_ml_job_wait_seconds_count"
        passed = "ojs_ml_scheduler_pass_seconds"  # the lock's renewals carry it

        def observed(s: Samples) -> bool:
            return _sum(s, waited) >= 4 and any(n == passed for n, _, _ in s)

        _, done = _poll(exporter, observed, "not every start, or no pass, was observed")
    assert _sum(busy, "ojs_ml_gpus", worker="four@test", gpu_type="nvidia-a100") == 4
    assert _sum(busy, "ojs_ml_workers") == 1
    assert [lab for n, lab, _ in busy if n == "ojs_ml_leader"] != [], "the leader is shown"
    assert {lab["queue"] for n, lab, _ in busy if n == "ojs_ml_jobs"} == {"celery"}
    assert _sum(done, waited) == 4
    assert {lab["band"] for n, lab, _ in done if n == waited} <= set(BANDS)
    assert _sum(done, "ojs_ml_jobs", state="running") == 0
    assert _sum(done, "ojs_ml_gpus", state="free") == 4
    assert not any(task_id in text for task_id in ids), "a task id is a label value"
    helped = set(re.findall(r"^# HELP (\w+) ", text, flags=re.M))
    assert helped == metric_names()
    app.close()


def test_a_job_whose_worker_dies_is_counted_as_a_crash_of_its_queue(
    exporter: str, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The survivor claims the dead worker's lease, re-publishes the job and says so."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    env = {"OJS_TEST_LEASE_TTL": "2"}
    workers = {
        name: WorkerProcess(
            name, redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2,
            extra_args=("-E",), extra_env=env,
        )
        for name in ("a", "b")
    }  # fmt: skip
    with running(list(workers.values()), store):
        job = app.tasks["ml.hold"].apply_async(args=["crash", 120.0]).id
        leases = LeaseBook(store, 2)
        deadline = time.monotonic() + _DEADLINE_S
        while not (found := [x for x in leases.all() if x["task_id"] == job]):
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.1)
        workers[found[0]["worker"].partition("@")[0]].kill()
        crashes = "ojs_ml_job_crashes_total"
        text, seen = _poll(exporter, lambda s: _sum(s, crashes) >= 1, "the crash was not counted")
        redis_client.set(HOLD_KEY + "crash", 1)
    assert _sum(seen, crashes, queue="celery") == 1
    assert job not in text
    app.close()
