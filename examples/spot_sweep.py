"""A hyperparameter sweep on spot capacity that escalates instead of starving (OJS ML §8.4).

    celery -A examples.spot_sweep worker --ojs-ml-capabilities=profile:nvidia-a100x1 -c 2
    python -m examples.spot_sweep

The sweep's trials are spot jobs (the OJS ML §13.4 example, scaled down), and
a stream of on-demand jobs keeps the one GPU busy: every on-demand job goes
before every spot job, so without escalation the trials would wait for the
whole stream. Each trial sets `ext_ml_priority_escalation`: once it has waited
`ext_ml_escalation_after_s` (2 s here; 3600 by default) the scheduler treats
it as `ext_ml_escalation_target_class`, and the trials, submitted first, run
next. The broker (and store) is `$OJS_EXAMPLE_BROKER`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_ojs_ml import OJSML

BROKER = os.environ.get("OJS_EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
# The app's name is the module's, so task names match under `python -m` too.
app = Celery("examples.spot_sweep", broker=BROKER, backend=BROKER)
ml = OJSML(app)

TRIAL = {
    "ext_ml_gpu_count": 1,
    "ext_ml_priority_class": "spot",
    "ext_ml_priority_escalation": True,
    "ext_ml_escalation_after_s": 2,
    "ext_ml_escalation_target_class": "on-demand",
}
SERVE = {"ext_ml_gpu_count": 1, "ext_ml_priority_class": "on-demand"}


@app.task(ml=TRIAL)
def trial(lr: float) -> dict[str, Any]:
    """One sweep trial: train briefly with learning rate `lr`, report the loss."""
    start = time.time()
    time.sleep(0.5)
    return {"job": f"trial lr={lr}", "start": start, "loss": abs(lr - 0.01) + 0.1}


@app.task(ml=SERVE)
def serve(n: int) -> dict[str, Any]:
    """An on-demand job of the stream that keeps the GPU busy."""
    start = time.time()
    time.sleep(0.5)
    return {"job": f"on-demand {n}", "start": start}


def main() -> None:
    t0 = time.time()
    trials = [trial.delay(lr) for lr in (0.1, 0.01, 0.001)]
    stream = [serve.delay(n) for n in range(8)]
    runs = sorted((job.get(timeout=120) for job in trials + stream), key=lambda r: r["start"])
    for run in runs:
        print(f"+{run['start'] - t0:4.1f} s  {run['job']}")
    best = min((r for r in runs if "loss" in r), key=lambda r: r["loss"])
    print(f"all {len(trials)} trials done; best: {best['job']} (loss {best['loss']:.2f})")


if __name__ == "__main__":
    main()
