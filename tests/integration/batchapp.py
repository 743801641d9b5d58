"""The integration tests' app (`mlapp`) with batched tasks (`ml_batch`) added.

`celery -A tests.integration.batchapp worker ...`. Each call of a batched task
records what it saw (its requests' ids, CUDA_VISIBLE_DEVICES, the devices the gate
pinned, the process and when it ran) in the Redis list `RESULTS_KEY`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_ojs_ml.child.batch import BatchRequest
from tests.integration import mlapp
from tests.integration.mlapp import RESULTS_KEY as RESULTS_KEY
from tests.integration.mlapp import make_app as make_ml_app

MAX_SIZE = 8
FAIL = -1
"""An argument the batched body answers with an exception (that request alone fails)."""


def make_app(broker: str, **conf: Any) -> Celery:
    app = make_ml_app(broker, **conf)
    _define_batched(app, os.environ.get("OJS_TEST_RESULTS", broker))
    return app


def _define_batched(app: Celery, results_url: str) -> None:
    batch = {"max_size": MAX_SIZE, "max_wait_ms": 50}

    @app.task(bind=True, name="ml.batch_double", shared=False, ml={"ext_ml_gpu_count": 1},
              ml_batch=batch)  # fmt: skip
    def batch_double(self: Any, requests: list[BatchRequest]) -> list[Any]:
        """Doubles each request's number; `FAIL` fails that request alone."""
        start = time.time()
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        with mlapp._CUDA_LOCK:
            if "cvd" not in mlapp._FIRST_GPU_USE:
                mlapp.init_fake_cuda()  # CUDA binds this child to its first batch's devices
                mlapp._FIRST_GPU_USE["cvd"] = cvd
        time.sleep(float(requests[0].kwargs.get("sleep_s", 0.0)))
        mlapp._record(results_url, {
            "tag": "batch",
            "ids": [r.id for r in requests],
            "xs": [r.args[0] for r in requests],
            "first_id": self.request.id,
            "devices": list(getattr(self.request, "ojs_devices", None) or []),
            "cvd": cvd,
            "first_cvd": mlapp._FIRST_GPU_USE.get("cvd"),
            "pid": os.getpid(),
            "start": start,
            "end": time.time(),
        })  # fmt: skip
        return [
            ValueError(f"request {r.id} asked to fail") if r.args[0] == FAIL
            else {"x": r.args[0], "y": 2 * r.args[0]}
            for r in requests
        ]  # fmt: skip

    @app.task(bind=True, name="ml.batch_slow", shared=False, ml={"ext_ml_gpu_count": 1},
              ml_batch=batch)  # fmt: skip
    def batch_slow(self: Any, requests: list[BatchRequest]) -> list[Any]:
        """Records its start, then runs `sleep_s` unless one of its requests was preempted
        before (a re-published request finishes at once)."""
        runs = [int(r.headers.get("ojs_preemptions") or 0) for r in requests]
        mlapp._record(results_url, {
            "tag": "slow-start", "ids": [r.id for r in requests], "preemptions": runs,
            "pid": os.getpid(), "start": time.time(),
        })  # fmt: skip
        if not any(runs):
            time.sleep(float(requests[0].kwargs.get("sleep_s", 0.0)))
        mlapp._record(results_url, {"tag": "slow-end", "ids": [r.id for r in requests]})
        return [r.args[0] for r in requests]


app = make_app(os.environ.get("OJS_TEST_BROKER", "redis://127.0.0.1:6399/0"))
