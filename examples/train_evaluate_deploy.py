"""Train, evaluate, deploy: the evaluation gates the deployment (OJS ML Extensions §5.4).

    celery -A examples.train_evaluate_deploy worker --ojs-ml-capabilities=profile:nvidia-a100x1 -c 2
    python -m examples.train_evaluate_deploy

The chain `train | evaluate_model | deploy` runs twice. `evaluate_model` judges
its metrics against the job's `ext_mlx_eval_thresholds` with
`evaluate(self, metrics)`, which raises `ThresholdsNotMet` on a miss, so Celery
runs none of the later steps. The good model is deployed; the bad one stops
before `deploy`, and the client reads the reason (metric, threshold, value)
from the chain's result. The broker (and store) is `$OJS_EXAMPLE_BROKER`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_ojs_ml import OJSML, ThresholdsNotMet, evaluate

BROKER = os.environ.get("OJS_EXAMPLE_BROKER", "redis://127.0.0.1:6379/0")
# The app's name is the module's, so task names match under `python -m` too.
app = Celery("examples.train_evaluate_deploy", broker=BROKER, backend=BROKER)
ml = OJSML(app)

EVAL = {
    "ext_ml_gpu_count": 1,
    "ext_mlx_eval_metrics": ["accuracy", "loss"],
    "ext_mlx_eval_thresholds": {"accuracy": {"min": 0.9}, "loss": {"max": 0.2}},
}


@app.task(ml={"ext_ml_gpu_count": 1})
def train(run: str, lr: float) -> dict[str, Any]:
    """Train a model (a stand-in: its quality depends on the learning rate)."""
    time.sleep(0.3)
    return {"model_uri": f"s3://models/{run}/", "lr": lr}


@app.task(bind=True, ml=EVAL)
def evaluate_model(self: Any, model: dict[str, Any]) -> dict[str, Any]:
    """Compute the metrics on held-out data, then gate on the job's thresholds."""
    accuracy = 0.95 if model["lr"] <= 0.01 else 0.71
    metrics = {"accuracy": accuracy, "loss": round(1 - accuracy, 2)}
    met = evaluate(self, metrics)  # raises ThresholdsNotMet on a miss
    return {**model, "metrics": metrics, "thresholds_met": met}


@app.task
def deploy(model: dict[str, Any]) -> str:
    """Roll the model out (a plain CPU task)."""
    return f"deployed {model['model_uri']} with {model['metrics']}"


def main() -> None:
    for run, lr in (("run-good", 0.01), ("run-bad", 0.3)):
        pipeline = (train.s(run, lr) | evaluate_model.s() | deploy.s()).apply_async()
        try:
            print(f"{run}: {pipeline.get(timeout=60)}")
        except ThresholdsNotMet as exc:
            print(f"{run}: not deployed: {exc}")


if __name__ == "__main__":
    main()
