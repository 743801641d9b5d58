"""The app of the run-time enforcement tests: `mlapp.make_app` plus the tasks they run.

`celery -A tests.integration.runapp worker ...` (`WorkerProcess(app=APP)`).

- `run.report` records what its process sees (pid, working directory, `FOO`,
  CPU affinity, the address-space limit, `CUDA_VISIBLE_DEVICES`, the gate's devices).
- `run.alloc` allocates `mib` MiB and touches every page (fails under a smaller limit).
- `wf.item`, `wf.collect`, `wf.alert` are a batch's jobs and its callbacks.
"""

from __future__ import annotations

import json
import os
import resource
from typing import Any

import redis
from celery import Celery

from celery_ojs_ml.wire import headers as h
from tests.integration.mlapp import make_app

APP = "tests.integration.runapp:app"
REPORTS_KEY = "ojs-test:run-reports"
ITEM_FAIL = "fail"
"""A `wf.item` argument that makes the job fail."""


def make_run_app(broker: str, **conf: Any) -> Celery:
    """The test app on `broker` with the tasks below."""
    app = make_app(broker, **conf)
    results_url = os.environ.get("OJS_TEST_RESULTS", broker)
    _define_run_tasks(app, results_url)
    _define_workflow_tasks(app, results_url)
    return app


def record(results_url: str, entry: dict[str, Any]) -> None:
    client = redis.Redis.from_url(results_url)
    try:
        client.rpush(REPORTS_KEY, json.dumps(entry))
    finally:
        client.close()


def reports(client: redis.Redis) -> list[dict[str, Any]]:
    """Every entry recorded so far, oldest first."""
    return [json.loads(e) for e in client.lrange(REPORTS_KEY, 0, -1)]


def _define_run_tasks(app: Celery, results_url: str) -> None:
    @app.task(bind=True, name="run.report", shared=False)
    def report(self: Any, tag: str) -> dict[str, Any]:
        entry = {
            "tag": tag,
            "pid": os.getpid(),
            "cwd": os.getcwd(),
            "foo": os.environ.get("FOO"),
            "affinity": sorted(os.sched_getaffinity(0)),
            "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0],
            "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "devices": list(getattr(self.request, h.DEVICES, None) or []),
        }
        record(results_url, entry)
        return entry

    @app.task(bind=True, name="run.alloc", shared=False)
    def alloc(self: Any, mib: int) -> int:
        block = bytearray(mib << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        record(results_url, {"tag": "alloc", "pid": os.getpid(), "mib": mib})
        return len(block) >> 20


def _define_workflow_tasks(app: Celery, results_url: str) -> None:
    @app.task(bind=True, name="wf.item", shared=False)
    def item(self: Any, value: str) -> str:
        record(results_url, {"tag": "item", "value": value})
        if value == ITEM_FAIL:
            raise RuntimeError("this batch job fails")
        return value.upper()

    @app.task(bind=True, name="wf.collect", shared=False)
    def collect(self: Any, results: list[str], label: str = "") -> list[str]:
        record(results_url, {"tag": "collect", "label": label, "results": results})
        return results

    @app.task(bind=True, name="wf.alert", shared=False)
    def alert(self: Any, results: list[Any], label: str = "") -> str:
        record(results_url, {"tag": "alert", "label": label, "results": results})
        return label


app = make_run_app(os.environ.get("OJS_TEST_BROKER", "redis://127.0.0.1:6399/0"))
