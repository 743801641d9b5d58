"""Validate and normalise the `ext_mlx_*` attributes of one job (OJS ML Extensions v0.1).

Key decision: one table maps every attribute of §4–§7 to a small checker.
`validate_mlx` walks the job once, each checker reports into a shared
collector, and a single `SpecError` names every violation at once.
Hyperparameters (§5.1) are handed back by identity and never looked inside.
Every URI attribute is an artifact URI for §12.1: a local file or an internal
host is reachable only under an operator's prefix (`spec/uris.py`).
Unknown `ext_mlx_*` attributes are kept with a warning, so jobs from newer
producers still pass. The only rewrite is lower-casing URI schemes, which
makes the function idempotent on its own output.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.mlx_checkers import (
    STEP_EXAMPLE,
    Checker,
    Collector,
    array_of,
    json_schema,
    metric_name,
    metric_thresholds,
    one_of,
    opaque_object,
    positive_int,
    show,
    split_ratios,
    text,
    transformation,
    version,
)
from celery_ojs_ml.spec.mlx_uris import artifact_uri

__all__ = ["DEFAULT_ARTIFACT_SCHEMES", "KNOWN_ATTRIBUTES", "PREFIX", "validate_mlx"]

PREFIX = "ext_mlx_"
#: §6 well-known artifact URI schemes; callers may narrow them per queue or tenant (§12.1).
DEFAULT_ARTIFACT_SCHEMES = frozenset({"s3", "gs", "az", "hdfs", "mlflow", "wandb", "hf", "file"})

MODEL_FRAMEWORKS = ("pytorch", "tensorflow", "onnx", "jax", "sklearn", "xgboost", "custom")
INFERENCE_MODES = ("batch", "streaming", "realtime")
DATA_FORMATS = ("csv", "parquet", "json", "jsonl", "tfrecord", "arrow", "custom")
ARTIFACT_REGISTRIES = ("s3", "gcs", "azure_blob", "mlflow", "wandb", "huggingface", "local")
GPU_AFFINITIES = ("spread", "pack", "dedicated")
PREEMPTION_POLICIES = ("never", "save_and_retry", "immediate")
SPOT_PREFERENCES = ("spot_preferred", "on_demand_only", "any")


def validate_mlx(
    attrs: Mapping[str, Any],
    *,
    uri_schemes: frozenset[str] = DEFAULT_ARTIFACT_SCHEMES,
    uri_prefixes: Sequence[str] = (),
) -> tuple[dict[str, Any], list[str]]:
    """Validate the ext_mlx_* keys of one job (attrs holds ONLY ext_mlx_* keys).

    `uri_schemes` and `uri_prefixes` are the artifact allow-lists (§12.1;
    settings `ojs_ml_artifact_schemes` and `ojs_ml_artifact_prefixes`).
    Returns (normalised dict, warnings). Raises SpecError listing every violation.
    """
    collector = Collector(frozenset(s.lower() for s in uri_schemes), tuple(uri_prefixes))
    out = {key: _check_attribute(key, value, collector) for key, value in attrs.items()}
    _warn_unmeasured_thresholds(out, collector)
    if collector.violations:
        raise SpecError(collector.violations)
    return out, collector.warnings


def _check_attribute(key: Any, value: Any, c: Collector) -> Any:
    checker = _ATTRIBUTES.get(key)
    if checker is not None:
        return checker(key, value, c)
    if isinstance(key, str) and key.startswith(PREFIX):
        c.warnings.append(_unknown_attribute_warning(key))
    else:
        fix = 'pass only ext_mlx_* attributes here, e.g. "ext_mlx_model_name": "resnet50"'
        path = key if isinstance(key, str) else show(key)
        c.fail(path, "is not an ext_mlx_* attribute", "§8", fix)
    return value


def _unknown_attribute_warning(key: str) -> str:
    warning = f"{key} is not defined by OJS ML Extensions v0.1 (§8); kept unchanged"
    close = difflib.get_close_matches(key, _ATTRIBUTES, n=1, cutoff=0.85)
    return f"{warning}; did you mean {close[0]}?" if close else warning


def _warn_unmeasured_thresholds(out: Mapping[str, Any], c: Collector) -> None:
    metrics, thresholds = out.get("ext_mlx_eval_metrics"), out.get("ext_mlx_eval_thresholds")
    if not isinstance(metrics, list) or not isinstance(thresholds, Mapping):
        return
    for metric in thresholds:
        if metric not in metrics:
            c.warnings.append(
                f"ext_mlx_eval_thresholds sets a threshold for {show(metric)}, which "
                "ext_mlx_eval_metrics does not list (§5.4); add it there or drop the threshold"
            )


_ATTRIBUTES: dict[str, Checker] = {
    # §4 model metadata
    "ext_mlx_model_name": text("§4", "resnet50-imagenet"),
    "ext_mlx_model_version": version,
    "ext_mlx_model_framework": one_of("§4.1", MODEL_FRAMEWORKS),
    "ext_mlx_model_input_schema": json_schema,
    "ext_mlx_model_output_schema": json_schema,
    "ext_mlx_experiment_id": text("§4", "exp-llama-finetune-2024"),
    "ext_mlx_run_id": text("§4", "run-001"),
    # §5.1 training
    "ext_mlx_training_dataset_uri": artifact_uri("§5.1"),
    "ext_mlx_training_validation_uri": artifact_uri("§5.1"),
    "ext_mlx_training_hyperparameters": opaque_object,
    "ext_mlx_training_epochs": positive_int("§5.1", 3),
    "ext_mlx_training_checkpoint_uri": artifact_uri("§5.1"),
    "ext_mlx_training_resume_from": artifact_uri("§5.1"),
    "ext_mlx_training_output_model_uri": artifact_uri("§5.1"),
    # §5.2 inference
    "ext_mlx_inference_model_uri": artifact_uri("§5.2"),
    "ext_mlx_inference_batch_size": positive_int("§5.2", 64),
    "ext_mlx_inference_timeout_ms": positive_int("§5.2", 5000),
    "ext_mlx_inference_input_uri": artifact_uri("§5.2"),
    "ext_mlx_inference_output_uri": artifact_uri("§5.2"),
    "ext_mlx_inference_mode": one_of("§5.2", INFERENCE_MODES),
    # §5.3 preprocessing
    "ext_mlx_preprocess_input_uri": artifact_uri("§5.3"),
    "ext_mlx_preprocess_output_uri": artifact_uri("§5.3"),
    "ext_mlx_preprocess_input_format": one_of("§5.3", DATA_FORMATS),
    "ext_mlx_preprocess_output_format": one_of("§5.3", DATA_FORMATS),
    "ext_mlx_preprocess_transformations": array_of(
        "§5.3", "an array of transformation objects", f"[{STEP_EXAMPLE}]", transformation
    ),
    "ext_mlx_preprocess_split_ratios": split_ratios,
    # §5.4 evaluation
    "ext_mlx_eval_dataset_uri": artifact_uri("§5.4"),
    "ext_mlx_eval_model_uri": artifact_uri("§5.4"),
    "ext_mlx_eval_metrics": array_of("§5.4", "an array of metric names", '["f1"]', metric_name),
    "ext_mlx_eval_thresholds": metric_thresholds,
    "ext_mlx_eval_output_uri": artifact_uri("§5.4"),
    "ext_mlx_eval_baseline_run_id": text("§5.4", "run-000"),
    # §6 artifacts
    "ext_mlx_artifact_model_uri": artifact_uri("§6"),
    "ext_mlx_artifact_dataset_uri": artifact_uri("§6"),
    "ext_mlx_artifact_checkpoint_uri": artifact_uri("§6"),
    "ext_mlx_artifact_output_uri": artifact_uri("§6"),
    "ext_mlx_artifact_registry": one_of("§6", ARTIFACT_REGISTRIES),
    # §7 scheduling hints
    "ext_mlx_scheduling_gpu_affinity": one_of("§7.1", GPU_AFFINITIES),
    "ext_mlx_scheduling_preemption_policy": one_of("§7", PREEMPTION_POLICIES),
    "ext_mlx_scheduling_spot_preference": one_of("§7", SPOT_PREFERENCES),
    "ext_mlx_scheduling_data_locality": artifact_uri("§7.2"),
}


#: Every attribute that OJS ML Extensions v0.1 defines (§8).
KNOWN_ATTRIBUTES = frozenset(_ATTRIBUTES)
