"""The OJS ML §8.3 workflow case: prepare data on CPU while 8 GPUs wait for training.

    celery -A examples.reservation_pipeline worker --ojs-ml-capabilities=profile:nvidia-a100x8 -c 8
    python -m examples.reservation_pipeline

The scheduler holds the reservation's 8 GPUs idle on one worker for jobs naming
it (`ext_ml_reservation_id`): `train` starts there the moment `prepare`
finishes, while another 8-GPU job, published meanwhile outside the
reservation, waits until `release` (or the reservation's timeout) frees them.
Without the reservation that job would have taken the GPUs while `prepare`
ran. The broker (and store) is `$OJS_EXAMPLE_BROKER`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_ojs_ml import OJSML, devices

BROKER = os.environ.get("OJS_EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
# The app's name is the module's, so task names match under `python -m` too.
app = Celery("examples.reservation_pipeline", broker=BROKER, backend=BROKER)
ml = OJSML(app)


@app.task
def prepare(dataset: str) -> str:
    """CPU-only data preparation (a plain Celery task: no ML attributes)."""
    time.sleep(1)
    return f"{dataset}.prepared"


@app.task(bind=True, ml={"ext_ml_gpu_count": 8})
def train(self: Any, shards: str) -> dict[str, Any]:
    """The training step; `ext_ml_reservation_id` is set per call."""
    start = time.time()
    time.sleep(0.5)
    return {"shards": shards, "devices": devices(self), "start": start, "end": time.time()}


def run_pipeline(dataset: str = "s3://bucket/corpus") -> dict[str, Any]:
    """Reserve 8 GPUs, run prepare | train inside the reservation, release."""
    rid = ml.reserve({"ext_ml_gpu_count": 8}, timeout_s=3600)
    print(f"reserved 8 GPUs: {rid}")
    try:
        step = train.s().set(headers={"ext_ml_reservation_id": rid})
        pipeline = (prepare.s(dataset) | step).apply_async()
        outside = train.delay("s3://bucket/other.prepared")  # not in the reservation
        result: dict[str, Any] = pipeline.get(timeout=600)
        print(f"prepare -> {pipeline.parent.get()}")
        print(f"train inside the reservation on GPUs {result['devices']} <- {result['shards']}")
    finally:
        ml.release(rid)
        print(f"released {rid}")
    waited = outside.get(timeout=600)["start"] - result["end"]
    print(f"the 8-GPU job outside the reservation started {waited:.1f} s after train ended")
    return result


def main() -> None:
    run_pipeline()


if __name__ == "__main__":
    main()
