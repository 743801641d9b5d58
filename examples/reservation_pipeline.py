"""The OJS ML §8.3 workflow case: prepare data on CPU while 8 GPUs wait for training.

Run it against a Redis broker with a GPU worker (simulated GPUs work too):

    celery -A examples.reservation_pipeline worker --ojs-ml-capabilities profile:nvidia-a100x8
    python -m examples.reservation_pipeline

Without the reservation, other GPU jobs published meanwhile may take the GPUs
while `prepare` runs, and `train` waits behind them. With it, the scheduler
holds 8 GPUs idle on one worker for jobs naming the reservation, `train`
starts there the moment `prepare` finishes, and the GPUs are freed with
`release` (or when the reservation times out).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_ojs_ml import OJSML

BROKER = os.environ.get("OJS_EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
app = Celery("reservation_pipeline", broker=BROKER, backend=BROKER)
ml = OJSML(app)


@app.task
def prepare(dataset: str) -> str:
    """CPU-only data preparation (a plain Celery task: no ML attributes)."""
    time.sleep(2)
    return f"{dataset}.prepared"


@app.task(bind=True, ml={"ext_ml_gpu_count": 8})
def train(self: Any, shards: str) -> dict[str, Any]:
    """The training step; `ext_ml_reservation_id` is set per call."""
    return {"shards": shards, "devices": getattr(self.request, "ojs_devices", None)}


def run_pipeline(dataset: str = "s3://bucket/corpus") -> dict[str, Any]:
    """Reserve 8 GPUs, run prepare | train inside the reservation, release."""
    rid = ml.reserve({"ext_ml_gpu_count": 8}, timeout_s=3600)
    try:
        step = train.s().set(headers={"ext_ml_reservation_id": rid})
        result: dict[str, Any] = (prepare.s(dataset) | step).apply_async().get(timeout=600)
        return result
    finally:
        ml.release(rid)


if __name__ == "__main__":
    print(run_pipeline())
