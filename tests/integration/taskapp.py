"""The app of the task-side helper tests: `mlapp.make_app` plus the tasks they run.

`celery -A tests.integration.taskapp worker ...` (`WorkerProcess(app=APP)`).
`ml.progress_steps` reports its progress and stops at one step until the test
releases it. `ml.preprocess`, `ml.train`, `ml.evaluate` and `ml.deploy` are the
task types of OJS ML Extensions example 9.1 (the complete training pipeline) in
miniature: each records its run in `PIPELINE_KEY`, the model's quality is the
`simulated_scores` the test puts in the train step's arguments, and the
evaluation judges it with `celery_ojs_ml.evaluate` against the step's
`ext_mlx_eval_thresholds`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_ojs_ml import evaluate, progress
from tests.integration.mlapp import HOLD_KEY, make_app

APP = "tests.integration.taskapp:app"
PIPELINE_KEY = "ojs-test:pipeline"


def make_task_app(broker: str, **conf: Any) -> Celery:
    """The test app on `broker` with the tasks below."""
    app = make_app(broker, **conf)
    results_url = os.environ.get("OJS_TEST_RESULTS", broker)
    _define_progress_task(app, results_url)
    _define_pipeline_tasks(app, results_url)
    return app


def _define_progress_task(app: Celery, results_url: str) -> None:
    @app.task(bind=True, name="ml.progress_steps", shared=False, ml={"ext_ml_gpu_count": 1})
    def progress_steps(self: Any, total: int, hold_at: int) -> int:
        """Steps 1..total, each reported; at `hold_at` it waits for `HOLD_KEY + id`."""
        client = redis.Redis.from_url(results_url)
        try:
            for step in range(1, total + 1):
                progress(self, step, total, loss=round(1 / step, 4), phase="train")
                deadline = time.monotonic() + 60
                while step == hold_at and not client.exists(HOLD_KEY + self.request.id):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the test never released the task")
                    time.sleep(0.02)
        finally:
            client.close()
        return total


def _record(results_url: str, task: Any, step: str, **extra: Any) -> None:
    client = redis.Redis.from_url(results_url)
    try:
        entry = {"step": step, "task_id": task.request.id, "root": task.request.root_id, **extra}
        client.rpush(PIPELINE_KEY, json.dumps(entry))
    finally:
        client.close()


def _define_pipeline_tasks(app: Celery, results_url: str) -> None:
    @app.task(bind=True, name="ml.preprocess", shared=False)
    def preprocess(self: Any, spec: dict[str, Any]) -> dict[str, Any]:
        _record(results_url, self, "preprocess")
        return {"dataset": "s3://processed/customer-tickets-v3/", "task": spec.get("task")}

    @app.task(bind=True, name="ml.train", shared=False)
    def train(self: Any, data: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
        _record(results_url, self, "train", gpus=getattr(self.request, "ext_ml_gpu_count", None))
        return {"model_uri": "s3://models/classifier/v1.0.0/", "scores": spec["simulated_scores"]}

    @app.task(bind=True, name="ml.evaluate", shared=False)
    def evaluate_model(self: Any, model: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
        _record(results_url, self, "evaluate")
        metrics = model["scores"]
        met = evaluate(self, metrics)  # raises ThresholdsNotMet on a miss (§5.4)
        return {"model_uri": model["model_uri"], "metrics": metrics, "thresholds_met": met}

    @app.task(bind=True, name="ml.deploy", shared=False)
    def deploy(self: Any, evaluation: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
        _record(results_url, self, "deploy", model_uri=spec["model_uri"])
        return {"deployed": spec["model_uri"], "evaluation": evaluation}


app = make_task_app(os.environ.get("OJS_TEST_BROKER", "redis://127.0.0.1:6399/0"))
