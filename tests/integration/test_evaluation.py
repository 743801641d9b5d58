"""OJS ML Extensions §5.4 evaluation thresholds gate the spec's pipeline example 9.1
(preprocess -> train -> evaluate -> deploy), submitted as the example's workflow to a
real worker: a model that meets `ext_mlx_eval_thresholds` is deployed; one that misses
stops the chain at the evaluation, which fails once, with the metric, threshold and
value, and is neither retried nor dead-lettered.

The workflow is examples/jobs/mlx-9.1-complete-training-pipeline.json as it is, every
step's `ext_ml_*` and `ext_mlx_*` declarations included; the test only adds the
`simulated_scores` the miniature train step returns as its model's quality."""

from __future__ import annotations

import copy
import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ojs_ml import ThresholdsNotMet
from celery_ojs_ml.cli.live import task_ids
from celery_ojs_ml.errors import ThresholdMiss
from celery_ojs_ml.store.deadletter import dead_jobs
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.taskapp import APP, PIPELINE_KEY, make_task_app
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PIPELINE = json.loads((ROOT / "examples/jobs/mlx-9.1-complete-training-pipeline.json").read_text())
QUEUES = "celery,cpu-workers,gpu-training,gpu-inference,deployment"
"""The logical queues of the example's steps (a worker runs the jobs of queues it consumes)."""
_TIMEOUT_S = 90.0


@dataclass
class Fleet:
    app: Celery
    client: redis.Redis
    store: OJSStore
    worker: WorkerProcess


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One worker with eight A100s (the train step asks for four) consuming every queue."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    store = OJSStore(client, prefix="ojs")
    logdir = tmp_path_factory.mktemp("evaluation")
    worker = WorkerProcess(
        "a", redis_url, "profile:nvidia-a100x8", logdir, app=APP, concurrency=2, queue=QUEUES
    )
    app = make_task_app(redis_url)
    try:
        worker.start().wait_live(store)
        yield Fleet(app, client, store, worker)
    finally:
        worker.stop(signal.SIGTERM)
        app.close()
        client.close()


def _submit(fleet: Fleet, scores: dict[str, float], **evaluate: Any) -> list[str]:
    """Submit example 9.1 with the train step's model scoring `scores` (and `evaluate`
    added to the evaluation step's declarations); its task ids."""
    doc = copy.deepcopy(PIPELINE)
    train = next(step for step in doc["steps"] if step["type"] == "ml.train")
    train["args"][0]["simulated_scores"] = scores
    next(step for step in doc["steps"] if step["type"] == "ml.evaluate").update(evaluate)
    ids = task_ids(fleet.app.ojs_ml.submit(doc))
    assert len(ids) == 4, ids
    return ids


def _runs(fleet: Fleet, root: str) -> list[dict[str, Any]]:
    entries = [json.loads(e) for e in fleet.client.lrange(PIPELINE_KEY, 0, -1)]
    return [e for e in entries if e["root"] == root]


def test_section_5_4_example_9_1_deploys_a_model_that_meets_its_eval_thresholds(
    fleet: Fleet,
) -> None:
    scores = {"accuracy": 0.94, "f1": 0.9, "precision": 0.93, "recall": 0.91}
    ids = _submit(fleet, scores)
    deployed = fleet.app.AsyncResult(ids[-1]).get(timeout=_TIMEOUT_S)
    assert deployed["deployed"] == "s3://models/classifier/v1.0.0/"
    assert deployed["evaluation"]["thresholds_met"] == {"accuracy": True, "f1": True}
    assert deployed["evaluation"]["metrics"] == scores
    runs = _runs(fleet, ids[0])
    assert [r["step"] for r in runs] == ["preprocess", "train", "evaluate", "deploy"]
    assert [r["task_id"] for r in runs] == ids
    assert runs[1]["gpus"] == 4, "the train step ran with the example's ext_ml_gpu_count"


def test_section_5_4_example_9_1_stops_before_deploy_when_a_threshold_is_missed(
    fleet: Fleet,
) -> None:
    scores = {"accuracy": 0.85, "f1": 0.9, "precision": 0.8, "recall": 0.9}
    ids = _submit(fleet, scores)
    evaluation, deploy = fleet.app.AsyncResult(ids[2]), fleet.app.AsyncResult(ids[3])
    with pytest.raises(ThresholdsNotMet) as raised:
        deploy.get(timeout=_TIMEOUT_S)
    assert evaluation.state == "FAILURE"
    failure = evaluation.result
    assert isinstance(failure, ThresholdsNotMet)
    assert failure.misses == [ThresholdMiss("accuracy", {"min": 0.92}, 0.85)]
    assert failure.results == {"accuracy": False, "f1": True}
    assert str(failure) == (
        "evaluation thresholds not met (OJS ML Extensions §5.4): accuracy 0.85 < min 0.92"
    )
    assert "accuracy 0.85 < min 0.92" in (evaluation.traceback or "")
    # Celery marks the chain's later steps failed with the same reason; they never ran.
    assert deploy.state == "FAILURE" and raised.value.misses == failure.misses
    runs = _runs(fleet, ids[0])
    assert [r["step"] for r in runs] == ["preprocess", "train", "evaluate"]
    assert dead_jobs(fleet.store) == [], "a verdict is not dead-lettered"
    assert "re-publishing" not in fleet.worker.output(), "nor retried as a crash"


def test_section_5_4_a_checkpointed_evaluation_that_misses_is_a_verdict_not_a_dead_letter(
    fleet: Fleet,
) -> None:
    """A checkpointed job that fails for good is dead-lettered for a retry (§14.2); a
    threshold miss is the evaluation's result, so it is not."""
    scores = {"accuracy": 0.95, "f1": 0.5, "precision": 0.9, "recall": 0.9}
    ids = _submit(fleet, scores, ext_ml_checkpoint_enabled=True)
    with pytest.raises(ThresholdsNotMet) as raised:
        fleet.app.AsyncResult(ids[3]).get(timeout=_TIMEOUT_S)
    assert raised.value.misses == [ThresholdMiss("f1", {"min": 0.88}, 0.5)]
    assert [r["step"] for r in _runs(fleet, ids[0])] == ["preprocess", "train", "evaluate"]
    # The worker's main process dead-letters right after it stores the failure; a job
    # it finishes later was handled after that.
    fleet.app.send_task("ml.preprocess", args=[{"task": "after"}]).get(timeout=_TIMEOUT_S)
    assert dead_jobs(fleet.store) == [], "a verdict is not dead-lettered"
