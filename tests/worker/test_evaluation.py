"""`evaluate(self, metrics)` (child/evaluation.py) and `ThresholdsNotMet` (errors.py):
OJS ML Extensions §5.4 evaluation thresholds, judged in the task body."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_ojs_ml import ThresholdsNotMet, evaluate
from celery_ojs_ml.child.evaluation import judge
from celery_ojs_ml.errors import SpecError, ThresholdMiss

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = json.loads((ROOT / "examples/jobs/mlx-5.4-evaluation-job.json").read_text())
THRESHOLDS = EXAMPLE["ext_mlx_eval_thresholds"]  # accuracy min .92, f1 min .88, p99 max 100
GOOD = {"accuracy": 0.95, "f1": 0.9, "precision": 0.93, "recall": 0.9, "latency_p99": 80.0}


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("evaluation", broker="memory://", backend="cache+memory://", set_as_current=False)
    yield app
    app.close()


def _evaluate(app: Celery, metrics: Any, ml: dict[str, Any] | None = None, **opts: Any) -> Any:
    """`evaluate(self, metrics)` in an eagerly run bound task declared with `ml`."""

    @app.task(bind=True, name="t.evaluate", shared=False, ml=ml or {})
    def run(self: Any) -> dict[str, bool]:
        return evaluate(self, metrics)

    outcome = run.apply(**opts)
    if outcome.failed():
        raise outcome.result
    return outcome.result


def test_section_5_4_metrics_meeting_every_threshold_return_each_verdict(app: Celery) -> None:
    ml = {k: v for k, v in EXAMPLE.items() if k.startswith("ext_mlx_eval")}
    assert _evaluate(app, GOOD, ml) == {"accuracy": True, "f1": True, "latency_p99": True}


def test_section_5_4_min_and_max_bounds_are_inclusive_and_max_bounds_loss_type_metrics() -> None:
    at_bounds = {"accuracy": 0.92, "f1": 0.88, "latency_p99": 100}
    assert judge(THRESHOLDS, at_bounds) == ({"accuracy": True, "f1": True, "latency_p99": True}, [])
    results, misses = judge({"loss": {"max": 0.15}}, {"loss": 0.2})
    assert results == {"loss": False}
    assert [str(m) for m in misses] == ["loss 0.2 > max 0.15"]
    both = {"accuracy": {"min": 0.5, "max": 0.99}}
    assert judge(both, {"accuracy": 1.0})[0] == {"accuracy": False}, "a min and a max: both hold"


def test_section_5_4_a_miss_raises_listing_each_metric_its_threshold_and_value(
    app: Celery,
) -> None:
    ml = {"ext_mlx_eval_thresholds": THRESHOLDS}
    with pytest.raises(ThresholdsNotMet) as caught:
        _evaluate(app, {"accuracy": 0.85, "latency_p99": 140.0, "f1": float("nan")}, ml)
    assert str(caught.value) == (
        "evaluation thresholds not met (OJS ML Extensions §5.4): accuracy 0.85 < min 0.92; "
        "f1 is NaN (threshold min 0.88); latency_p99 140 > max 100"
    )
    assert [m.metric for m in caught.value.misses] == ["accuracy", "f1", "latency_p99"]
    assert caught.value.misses[2] == ThresholdMiss("latency_p99", {"max": 100.0}, 140.0)
    assert caught.value.results == {"accuracy": False, "f1": False, "latency_p99": False}


def test_section_5_4_a_threshold_whose_metric_was_not_reported_is_a_miss_with_value_none(
    app: Celery,
) -> None:
    ml = {"ext_mlx_eval_thresholds": THRESHOLDS}
    with pytest.raises(ThresholdsNotMet) as caught:
        _evaluate(app, {"accuracy": 0.95, "latency_p99": 10, "f1": None}, ml)
    [miss] = caught.value.misses
    assert (miss.metric, miss.value, miss.threshold) == ("f1", None, {"min": 0.88})
    assert "f1 not reported (threshold min 0.88)" in str(caught.value)
    assert caught.value.results == {"accuracy": True, "f1": False, "latency_p99": True}


def test_the_calls_headers_win_over_the_tasks_declaration(app: Celery) -> None:
    ml = {"ext_mlx_eval_thresholds": {"accuracy": {"min": 0.99}}}
    headers = {"ext_mlx_eval_thresholds": {"accuracy": {"min": 0.5}}}
    assert _evaluate(app, {"accuracy": 0.9}, ml, headers=headers) == {"accuracy": True}


def test_a_job_without_thresholds_passes_with_no_verdicts(app: Celery) -> None:
    assert _evaluate(app, {"accuracy": 0.1}) == {}


def test_a_malformed_declaration_fails_with_the_validators_message(app: Celery) -> None:
    ml = {"ext_mlx_eval_thresholds": {"accuracy": 0.9}}
    with pytest.raises(SpecError) as caught:
        _evaluate(app, {"accuracy": 0.95}, ml)
    assert caught.value.paths == ["ext_mlx_eval_thresholds.accuracy"]
    assert "min and/or max" in str(caught.value)


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"accuracy": "high"}, "metrics['accuracy'] is 'high' (str); a metric is a number"),
        ({"accuracy": True}, "metrics['accuracy'] is True (bool)"),
        ([0.9], "metrics is list; pass a mapping"),
    ],
)
def test_metrics_that_are_not_numbers_are_rejected_naming_the_metric(
    app: Celery, metrics: Any, message: str
) -> None:
    with pytest.raises(TypeError) as caught:
        _evaluate(app, metrics, {"ext_mlx_eval_thresholds": THRESHOLDS})
    assert message in str(caught.value) and "e.g. evaluate(self" in str(caught.value)


def test_thresholds_not_met_survives_the_json_result_backend_and_pickle(app: Celery) -> None:
    exc = ThresholdsNotMet(
        [ThresholdMiss("accuracy", {"min": 0.92}, 0.85), ThresholdMiss("f1", {"min": 0.88}, None)],
        {"accuracy": False, "f1": False},
    )
    backend = app.backend
    stored = json.loads(json.dumps(backend.prepare_exception(exc, "json")))
    for copy in (backend.exception_to_python(stored), pickle.loads(pickle.dumps(exc))):
        assert isinstance(copy, ThresholdsNotMet)
        assert copy.misses == exc.misses and copy.results == exc.results
        assert str(copy) == str(exc)
