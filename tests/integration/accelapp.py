"""The app of the URI allow-list and TPU pinning tests: `mlapp.make_app` plus the tasks they run.

`celery -A tests.integration.accelapp worker ...` (`WorkerProcess(app=APP)`).
`accel.env` records the accelerator variables its process sees and the chips the
gate gave it, then waits for `HOLD_KEY + tag` so a test can keep several running
at once. `accel.ckpt_save` saves a checkpoint through the task-side helper to the
storage URI its message names.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_ojs_ml import checkpoint
from celery_ojs_ml.wire import headers as h
from tests.integration.mlapp import HOLD_KEY, make_app

APP = "tests.integration.accelapp:app"
ENV_KEY = "ojs-test:accel-env"
NAMES = (
    "TPU_VISIBLE_CHIPS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_PROCESS_BOUNDS",
    "TPU_PROCESS_ADDRESSES",
    "TPU_PROCESS_PORT",
    "CUDA_VISIBLE_DEVICES",
)


def make_accel_app(broker: str, **conf: Any) -> Celery:
    """The test app on `broker` with the tasks below."""
    app = make_app(broker, **conf)
    results_url = os.environ.get("OJS_TEST_RESULTS", broker)
    _define_tasks(app, results_url)
    return app


def _define_tasks(app: Celery, results_url: str) -> None:
    @app.task(bind=True, name="accel.env", shared=False)
    def env(self: Any, tag: str, limit_s: float = 60.0) -> dict[str, Any]:
        """Record what this process sees, then hold until the test releases `tag`."""
        client = redis.Redis.from_url(results_url)
        try:
            entry = {
                "tag": tag,
                "task_id": self.request.id,
                "pid": os.getpid(),
                "chips": getattr(self.request, h.TPU_CHIPS, None),
                "env": {name: os.environ.get(name) for name in NAMES},
            }
            client.rpush(ENV_KEY, json.dumps(entry))
            start = time.monotonic()
            while not client.exists(HOLD_KEY + tag) and time.monotonic() - start < limit_s:
                time.sleep(0.02)
            return entry
        finally:
            client.close()

    @app.task(bind=True, name="accel.ckpt_save", shared=False)
    def ckpt_save(self: Any) -> str:
        """Save one checkpoint where the message's `ext_ml_checkpoint_storage_uri` says."""
        meta = checkpoint(self).save(epoch=0, files={"model.pt": b"weights"})
        return str(meta.storage_key)


app = make_accel_app(os.environ.get("OJS_TEST_BROKER", "redis://127.0.0.1:6399/0"))
