"""Spot training that survives preemption: checkpoint every step, yield, resume.

    celery -A examples.spot_training worker --ojs-ml-capabilities=profile:nvidia-a100x1 -c 2
    python -m examples.spot_training

`train` runs as a spot job on the worker's one (simulated) GPU and commits a
checkpoint after every step (OJS ML §9). A reserved job that needs the GPU
arrives; the scheduler asks `train` to yield (§8.2), `train` stops at its next
`yield_if_preempted()`, and the worker re-publishes it with the same id. The
reserved job runs, then `train` resumes from its last committed checkpoint and
finishes. The broker (and store) is `$OJS_EXAMPLE_BROKER`; checkpoints go
under `$OJS_EXAMPLE_CKPT` (default `file:///tmp/ojs-example-ckpt/`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

from celery_ojs_ml import OJSML, checkpoint, devices
from celery_ojs_ml.checkpoint import last_checkpoint

BROKER = os.environ.get("OJS_EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
CKPT = os.environ.get("OJS_EXAMPLE_CKPT", "file:///tmp/ojs-example-ckpt/")
# The app's name is the module's, so task names match under `python -m` too.
app = Celery("examples.spot_training", broker=BROKER, backend=BROKER)
app.conf.ojs_ml_checkpoint_prefixes = [CKPT]  # file:// storage must be allowed explicitly
app.conf.ojs_ml_min_runtime_before_preemption_s = 0  # the default 60 s protects young jobs
ml = OJSML(app)

SPOT = {
    "ext_ml_gpu_count": 1,
    "ext_ml_priority_class": "spot",
    "ext_ml_preemption_grace_period_s": 10,
    "ext_ml_checkpoint_enabled": True,
    "ext_ml_checkpoint_storage_uri": CKPT,
}
RESERVED = {"ext_ml_gpu_count": 1, "ext_ml_priority_class": "reserved"}


@app.task(bind=True, ml=SPOT)
def train(self: Any, steps: int = 20) -> dict[str, Any]:
    """One 0.25 s step at a time, a checkpoint after each; yield when asked."""
    ckpt = checkpoint(self)
    last = ckpt.resume()  # None on the first run
    state = json.loads(ckpt.load_bytes("state.json")) if last else {"step": -1, "w": 0.0}
    resumed_at = state["step"] + 1
    for step in range(resumed_at, steps):
        time.sleep(0.25)  # the training step
        state = {"step": step, "w": state["w"] + 0.5}
        ckpt.save(step=step, files={"state.json": json.dumps(state).encode()})
        ckpt.yield_if_preempted()  # raises Preempted: the worker re-publishes this job
    preemptions = getattr(self.request, "ojs_preemptions", 0) or 0
    return {"resumed_at": resumed_at, "preemptions": preemptions, "w": state["w"]}


@app.task(bind=True, ml=RESERVED)
def urgent(self: Any) -> str:
    """A reserved job: it may take the GPU from a spot job."""
    time.sleep(0.5)
    return f"urgent job ran on GPU {devices(self)}"


def main(steps: int = 20) -> None:
    job = train.delay(steps)
    meta = None
    while meta is None:  # wait for its first committed checkpoint
        time.sleep(0.1)
        meta = last_checkpoint(ml.store, job.id)
    print(f"train {job.id}: step {meta.step} committed; sending a reserved job")
    print(urgent.delay().get(timeout=60))
    result = job.get(timeout=120)
    print(
        f"train: preempted {result['preemptions']} time(s), resumed at step "
        f"{result['resumed_at']}, finished {steps} steps (w={result['w']})"
    )


if __name__ == "__main__":
    main()
