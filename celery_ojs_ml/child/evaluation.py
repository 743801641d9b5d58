"""`evaluate(self, metrics)`: gate a pipeline on the job's evaluation thresholds.

    @app.task(bind=True)
    def evaluate_model(self, model):
        metrics = {"accuracy": 0.94, "f1": 0.90}
        met = evaluate(self, metrics)  # raises ThresholdsNotMet on a miss
        return {"metrics": metrics, "thresholds_met": met}

Key decisions (OJS ML Extensions §5.4):
* The thresholds are the job's own `ext_mlx_eval_thresholds`, read as the
  checkpoint helper reads its settings: the message headers first (the router
  stamps the canonical `ext_mlx_*` attributes there; per-call headers and
  workflow steps arrive that way), then the task's `ml=` option. They pass the
  publish-time validator again, so a task run without the router gets the same
  errors.
* The spec writes each threshold as `{"min": x}`, `{"max": y}` or both; "maximum,
  for loss-type metrics" is the producer writing `max` for them. A value meets
  `min` when value >= min and `max` when value <= max, both ends inclusive. The
  direction is never guessed from a metric's name.
* A threshold whose metric is missing from `metrics` (or None) is a miss with
  value None; NaN meets no threshold. Metrics without a threshold are not judged.
* Any miss raises `ThresholdsNotMet` (errors.py, so a client rebuilds it from the
  result backend with its `.misses`): in a chain, Celery runs none of the later
  steps. The per-threshold verdicts are returned (and carried as `.results`) so
  the task can put them in its result, as §5.4 asks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from numbers import Real
from typing import Any

from celery_ojs_ml.errors import ThresholdMiss, ThresholdsNotMet
from celery_ojs_ml.spec.mlx import validate_mlx

log = logging.getLogger(__name__)
THRESHOLDS = "ext_mlx_eval_thresholds"
METRICS = "ext_mlx_eval_metrics"
_EXAMPLE = 'e.g. evaluate(self, {"accuracy": 0.94, "f1": 0.9})'


def evaluate(task: Any, metrics: Mapping[str, float]) -> dict[str, bool]:
    """Judge `metrics` against the job's `ext_mlx_eval_thresholds`; returns
    `{metric: met}` for every threshold, or raises `ThresholdsNotMet` listing the misses.

    A job without thresholds returns `{}`.
    """
    values = _checked(metrics)
    thresholds = declared_thresholds(task)
    _warn_unreported(task, values)
    results, misses = judge(thresholds, values)
    if misses:
        raise ThresholdsNotMet(misses, results)
    return results


def judge(
    thresholds: Mapping[str, Mapping[str, float]], metrics: Mapping[str, float | None]
) -> tuple[dict[str, bool], list[ThresholdMiss]]:
    """`({metric: met}, misses)` of `metrics` against validated §5.4 thresholds."""
    results: dict[str, bool] = {}
    misses: list[ThresholdMiss] = []
    for metric, bounds in thresholds.items():
        value = metrics.get(metric)
        met = value is not None and meets(value, bounds)
        results[metric] = met
        if not met:
            misses.append(ThresholdMiss(metric, dict(bounds), value))
    return results, misses


def meets(value: float, bounds: Mapping[str, float]) -> bool:
    """Whether `value` is within `{"min", "max"}`, both inclusive; NaN never is."""
    if math.isnan(value):
        return False
    low, high = bounds.get("min"), bounds.get("max")
    return (low is None or value >= low) and (high is None or value <= high)


def declared_thresholds(task: Any) -> dict[str, dict[str, float]]:
    """The job's validated `ext_mlx_eval_thresholds` (empty when it declares none)."""
    found = _declared(task, THRESHOLDS)
    if found is None:
        return {}
    validate_mlx({THRESHOLDS: found})  # SpecError: e.g. declared on a task run eagerly
    return {str(k): {b: float(v) for b, v in dict(bounds).items()} for k, bounds in found.items()}


def _checked(metrics: Any) -> dict[str, float | None]:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics is {type(metrics).__name__}; pass a mapping, {_EXAMPLE}")
    out: dict[str, float | None] = {}
    for name, value in metrics.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, Real)):
            raise TypeError(
                f"metrics[{name!r}] is {value!r} ({type(value).__name__}); a metric is a "
                f"number, {_EXAMPLE} (a tensor: pass acc.item())"
            )
        out[str(name)] = None if value is None else float(value)
    return out


def _warn_unreported(task: Any, values: Mapping[str, float | None]) -> None:
    declared = _declared(task, METRICS)
    if not isinstance(declared, list):
        return
    missing = [m for m in declared if values.get(m) is None]
    if missing:
        log.warning(
            "ojs-ml: %s did not report %s, which its ext_mlx_eval_metrics lists (§5.4)",
            getattr(getattr(task, "request", None), "id", None),
            ", ".join(str(m) for m in missing),
        )


def _declared(task: Any, key: str) -> Any:
    """A job attribute: the request's headers first, then the task's `ml=` option."""
    request = getattr(task, "request", None)
    value = getattr(request, key, None)
    if value is None:
        headers = getattr(request, "headers", None)
        value = headers.get(key) if isinstance(headers, Mapping) else None
    declared = getattr(task, "ml", None)
    if value is None and isinstance(declared, Mapping):
        value = declared.get(key)
    return value
