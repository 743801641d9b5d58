"""CPU cores and memory enforced on a real worker (OJS ML §3.4, §3.5): a job runs on as many
CPUs as its `ext_ml_cpu_cores`, and one that allocates past its `ext_ml_memory_gb` fails with
a reason naming it; the pool child serves the next job with the worker's CPUs and no bound.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.runapp import APP, make_run_app, reports
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

CAPS = '{"accelerator": "cpu", "cpu_cores": 2, "memory_gb": 8}'
HOST_CPUS = sorted(os.sched_getaffinity(0))


def _report(client: redis.Redis, tag: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [e for e in reports(client) if e["tag"] == tag]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"{tag} never reported"
        time.sleep(0.05)


def test_a_job_runs_on_its_own_cpus_and_the_next_job_gets_them_all_back_section_3_5(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_run_app(redis_url)
    report = app.tasks["run.report"]
    worker = WorkerProcess("cpus", redis_url, CAPS, tmp_path, concurrency=1, app=APP)
    with running([worker], store):
        report.apply_async(args=["one-core"], headers={"ext_ml_cpu_cores": 1}).get(timeout=60)
        report.apply_async(args=["plain"]).get(timeout=60)
        pinned, after = _report(redis_client, "one-core"), _report(redis_client, "plain")
    app.close()

    assert len(pinned["affinity"]) == 1
    assert set(pinned["affinity"]) <= set(HOST_CPUS)
    assert after["pid"] == pinned["pid"]  # the same pool child
    assert after["affinity"] == HOST_CPUS


def test_a_job_past_its_memory_bound_fails_naming_ext_ml_memory_gb_and_the_worker_goes_on(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """§3.4: the job fails with the reason; the next jobs in the same child run unbounded."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_run_app(redis_url)
    small = {"ext_ml_cpu_cores": 1, "ext_ml_memory_gb": 0.25}
    worker = WorkerProcess("mem", redis_url, CAPS, tmp_path, concurrency=1, app=APP)
    with running([worker], store):
        failed = app.tasks["run.alloc"].apply_async(args=[1024], headers=small)
        with pytest.raises(MemoryError) as found:
            failed.get(timeout=60)
        fits = app.tasks["run.alloc"].apply_async(args=[16], headers=small).get(timeout=60)
        app.tasks["run.report"].apply_async(args=["after"]).get(timeout=60)
        after = _report(redis_client, "after")
        fitted = [e for e in reports(redis_client) if e["tag"] == "alloc"]
    app.close()

    assert str(found.value).startswith("ext_ml_memory_gb 0.25 exceeded: the job ran out")
    assert fits == 16
    assert [e["pid"] for e in fitted] == [after["pid"]]  # the child that failed served on
    assert after["rlimit_as"] == resource.getrlimit(resource.RLIMIT_AS)[0]
