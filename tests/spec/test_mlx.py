"""Tests for `celery_ojs_ml.spec.mlx`: the OJS ML Extensions v0.1 `ext_mlx_*` validator.

Every MUST of the extensions spec has a test whose docstring cites its section.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.mlx import (
    DEFAULT_ARTIFACT_SCHEMES,
    KNOWN_ATTRIBUTES,
    validate_mlx,
)

SPEC_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "spec"
SPEC_FILE = SPEC_DIR / "ojs-ml-extensions-v0.1.md"

URI_ATTRIBUTES = sorted(
    a for a in KNOWN_ATTRIBUTES if a.endswith("_uri") or a.endswith(("_resume_from", "_locality"))
)


def violations_of(attrs: dict[str, Any], **kwargs: Any) -> list[str]:
    with pytest.raises(SpecError) as info:
        validate_mlx(attrs, **kwargs)
    return [str(v) for v in info.value.violations]


def paths_of(attrs: dict[str, Any], **kwargs: Any) -> list[str]:
    with pytest.raises(SpecError) as info:
        validate_mlx(attrs, **kwargs)
    return info.value.paths


def spec_text() -> str:
    if not SPEC_FILE.is_file():
        pytest.fail(
            f"the OJS ML Extensions spec is missing: expected {SPEC_FILE} "
            "(the shared/ folder sits beside the repository root)"
        )
    return SPEC_FILE.read_text(encoding="utf-8")


def spec_examples() -> list[tuple[str, dict[str, Any]]]:
    """The ext_mlx_* keys of every example job in the spec, workflow steps included."""
    examples = []
    for n, block in enumerate(re.findall(r"```json\n(.*?)```", spec_text(), re.DOTALL)):
        try:
            doc = json.loads(block)
        except json.JSONDecodeError:
            continue
        jobs = [doc] + [s for key in ("steps", "jobs") for s in doc.get(key, [])]
        for i, job in enumerate(jobs):
            attrs = {k: v for k, v in job.items() if k.startswith("ext_mlx_")}
            if attrs:
                examples.append((f"json block {n}, object {i}", attrs))
    return examples


# -- the spec's own examples and attribute list ---------------------------------------------


def test_every_example_job_in_the_spec_passes_including_workflow_steps() -> None:
    """§1.3: all JSON examples are normative, so each must validate without warnings."""
    examples = spec_examples()
    failures = {}
    for where, attrs in examples:
        try:
            out, warnings = validate_mlx(attrs)
        except SpecError as exc:
            failures[where] = str(exc)
        else:
            assert out == attrs, where
            assert warnings == [], where
    assert failures == {}
    assert len(examples) >= 16, "expected §4.2–§10.2 examples and the 7 workflow steps"


def test_the_validator_knows_exactly_the_attributes_listed_in_the_spec_summary() -> None:
    """§8 lists every attribute of §4–§7; none is missing and none is invented."""
    summary = spec_text().split("## 8. Extension Attributes Summary")[1].split("## 9.")[0]
    assert set(re.findall(r"`(ext_mlx_\w+)`", summary)) == KNOWN_ATTRIBUTES


def test_a_job_without_ext_mlx_attributes_is_valid_because_all_are_optional() -> None:
    """§5 makes the attributes OPTIONAL and §7: backends MUST NOT require scheduling hints."""
    assert validate_mlx({}) == ({}, [])


def test_a_job_with_only_non_scheduling_attributes_needs_no_scheduling_hints() -> None:
    """§7: backends MUST NOT require the scheduling hints."""
    assert validate_mlx({"ext_mlx_model_name": "m"}) == ({"ext_mlx_model_name": "m"}, [])


# -- §5.3 split ratios -----------------------------------------------------------------------


def test_split_ratios_that_sum_to_0_9_are_rejected_naming_the_attribute() -> None:
    """§5.3: the ratios MUST sum to 1.0."""
    ratios = {"train": 0.8, "validation": 0.05, "test": 0.05}
    assert violations_of({"ext_mlx_preprocess_split_ratios": ratios}) == [
        "ext_mlx_preprocess_split_ratios sum to 0.9, not 1.0 (OJS ML Extensions §5.3); "
        'make the ratios add up to 1.0, e.g. {"train": 0.8, "validation": 0.1, "test": 0.1}'
    ]


@pytest.mark.parametrize(
    "ratios",
    [
        {"train": 0.7, "validation": 0.2, "test": 0.1},
        {"train": 1 / 3, "validation": 1 / 3, "test": 1 / 3},
        {"train": 0.9999995, "test": 0.0},
        {"all": 1},
    ],
)
def test_split_ratios_that_sum_to_1_within_a_millionth_are_accepted(
    ratios: dict[str, float],
) -> None:
    """§5.3: the ratios MUST sum to 1.0; float rounding within 1e-6 is tolerated."""
    assert validate_mlx({"ext_mlx_preprocess_split_ratios": ratios})[0] == {
        "ext_mlx_preprocess_split_ratios": ratios
    }


def test_split_ratios_that_miss_1_by_more_than_a_millionth_are_rejected() -> None:
    """§5.3: the ratios MUST sum to 1.0."""
    attrs = {"ext_mlx_preprocess_split_ratios": {"train": 0.800002, "test": 0.2}}
    assert paths_of(attrs) == ["ext_mlx_preprocess_split_ratios"]


def test_an_empty_split_ratio_object_is_rejected_because_it_sums_to_0() -> None:
    """§5.3: the ratios MUST sum to 1.0."""
    assert "sum to 0, not 1.0" in violations_of({"ext_mlx_preprocess_split_ratios": {}})[0]


@pytest.mark.parametrize("bad", [1.5, -0.1, "0.5", True, None, float("nan"), float("inf"), 10**400])
def test_a_split_ratio_that_is_not_a_number_from_0_to_1_is_rejected_by_name(bad: Any) -> None:
    """§5.3: each ratio is a fraction of the data."""
    attrs = {"ext_mlx_preprocess_split_ratios": {"train": bad, "test": 0.2}}
    assert paths_of(attrs) == ["ext_mlx_preprocess_split_ratios.train"]


# -- §5.1 hyperparameters --------------------------------------------------------------------


class Tripwire:
    """A value that fails the test if the validator looks at it in any way."""

    def _touched(self, *args: Any) -> Any:
        raise AssertionError("the validator inspected a hyperparameter value")

    __eq__ = __hash__ = __repr__ = __str__ = __bool__ = _touched
    __iter__ = __len__ = __getitem__ = __float__ = __int__ = __index__ = _touched
    __reduce_ex__ = __copy__ = __deepcopy__ = _touched


def test_hyperparameters_are_handed_back_as_the_very_same_object_unchanged() -> None:
    """§5.1: backends MUST preserve hyperparameters exactly as provided and MUST NOT modify them."""
    hyper = {
        "learning_rate": 2e-5,
        "batch_size": 32,
        "schedule": [{"warmup": 500}, None, [1, 2.5, "x"]],
        "": {"nested": {"deep": True}},
        "epochs": "3",
        "unicode": "λ→∞",
    }
    snapshot = json.loads(json.dumps(hyper))
    out, warnings = validate_mlx({"ext_mlx_training_hyperparameters": hyper})
    assert out["ext_mlx_training_hyperparameters"] is hyper
    assert hyper == snapshot
    assert out["ext_mlx_training_hyperparameters"]["learning_rate"] == 2e-5
    assert warnings == []


def test_hyperparameter_values_are_never_evaluated_or_even_looked_at() -> None:
    """§5.1 MUST NOT interpret or validate hyperparameters; §12.2 MUST NOT evaluate them as code."""
    wire = Tripwire()
    code = "__import__('os').system('rm -rf /')"
    hyper = {"optimizer": code, "callback": wire, "lambda": "lambda: 1/0"}
    out, _ = validate_mlx({"ext_mlx_training_hyperparameters": hyper})
    assert out["ext_mlx_training_hyperparameters"]["callback"] is wire
    assert out["ext_mlx_training_hyperparameters"]["optimizer"] == code


def test_hyperparameters_that_look_like_secrets_are_still_passed_through_untouched() -> None:
    """§5.1 MUST NOT validate hyperparameter values wins over the §12.4 credential scan."""
    hyper = {"api_key": "not-really", "epochs": -1, "lr": "NaN"}
    assert validate_mlx({"ext_mlx_training_hyperparameters": hyper})[0] == {
        "ext_mlx_training_hyperparameters": hyper
    }


@pytest.mark.parametrize("bad", [[("lr", 0.1)], "lr=0.1", 3, None])
def test_hyperparameters_that_are_not_an_object_are_rejected(bad: Any) -> None:
    """§5.1: the attribute's type is object (a key-value map)."""
    assert paths_of({"ext_mlx_training_hyperparameters": bad}) == [
        "ext_mlx_training_hyperparameters"
    ]


# -- types and enums -------------------------------------------------------------------------

ENUMS = {
    "ext_mlx_model_framework": ["pytorch", "tensorflow", "onnx", "jax", "sklearn", "xgboost"],
    "ext_mlx_inference_mode": ["batch", "streaming", "realtime"],
    "ext_mlx_preprocess_input_format": ["csv", "parquet", "json", "jsonl", "tfrecord", "arrow"],
    "ext_mlx_preprocess_output_format": ["custom"],
    "ext_mlx_artifact_registry": ["s3", "gcs", "azure_blob", "mlflow", "wandb", "huggingface"],
    "ext_mlx_scheduling_gpu_affinity": ["spread", "pack", "dedicated"],
    "ext_mlx_scheduling_preemption_policy": ["never", "save_and_retry", "immediate"],
    "ext_mlx_scheduling_spot_preference": ["spot_preferred", "on_demand_only", "any"],
}


@pytest.mark.parametrize(
    ("attribute", "value"), [(a, v) for a, values in ENUMS.items() for v in values]
)
def test_every_enumerated_value_in_the_spec_is_accepted(attribute: str, value: str) -> None:
    assert validate_mlx({attribute: value}) == ({attribute: value}, [])


BAD_VALUES = [
    ("ext_mlx_model_name", 5),
    ("ext_mlx_model_name", "   "),
    ("ext_mlx_model_version", 2.1),
    ("ext_mlx_experiment_id", None),
    ("ext_mlx_run_id", ""),
    ("ext_mlx_eval_baseline_run_id", ["run-000"]),
    ("ext_mlx_model_framework", "PyTorch"),
    ("ext_mlx_model_framework", "torch"),
    ("ext_mlx_inference_mode", "online"),
    ("ext_mlx_preprocess_input_format", "xlsx"),
    ("ext_mlx_preprocess_output_format", "PARQUET"),
    ("ext_mlx_artifact_registry", "gs"),
    ("ext_mlx_scheduling_gpu_affinity", "packed"),
    ("ext_mlx_scheduling_preemption_policy", "save-and-retry"),
    ("ext_mlx_scheduling_spot_preference", "spot"),
    ("ext_mlx_training_epochs", 0),
    ("ext_mlx_training_epochs", "3"),
    ("ext_mlx_training_epochs", 3.0),
    ("ext_mlx_training_epochs", True),
    ("ext_mlx_inference_batch_size", -64),
    ("ext_mlx_inference_timeout_ms", 0),
    ("ext_mlx_inference_timeout_ms", 5.5),
    ("ext_mlx_model_input_schema", "string"),
    ("ext_mlx_model_output_schema", True),
    ("ext_mlx_eval_metrics", "accuracy"),
    ("ext_mlx_eval_thresholds", [{"min": 0.9}]),
    ("ext_mlx_preprocess_transformations", {"type": "filter"}),
    ("ext_mlx_preprocess_split_ratios", [0.8, 0.1, 0.1]),
    ("ext_mlx_training_dataset_uri", 42),
]


@pytest.mark.parametrize(("attribute", "value"), BAD_VALUES)
def test_a_value_of_the_wrong_type_or_outside_the_enum_is_rejected_by_name(
    attribute: str, value: Any
) -> None:
    """§4–§7: every attribute has a type, and some an enumerated set of values."""
    assert paths_of({attribute: value}) == [attribute]


def test_a_framework_in_the_wrong_case_is_rejected_with_the_valid_values_and_a_fix() -> None:
    assert violations_of({"ext_mlx_model_framework": "PyTorch"}) == [
        'ext_mlx_model_framework is "PyTorch", not one of pytorch, tensorflow, onnx, jax, '
        "sklearn, xgboost, custom (OJS ML Extensions §4.1); use one of them, e.g. "
        '"ext_mlx_model_framework": "pytorch"'
    ]


def test_a_boolean_epoch_count_is_rejected_because_booleans_are_not_integers() -> None:
    assert violations_of({"ext_mlx_training_epochs": True}) == [
        "ext_mlx_training_epochs is a boolean (true), not an integer (OJS ML Extensions §5.1); "
        'use an integer, e.g. "ext_mlx_training_epochs": 3'
    ]


def test_zero_epochs_are_rejected_with_a_positive_example() -> None:
    assert violations_of({"ext_mlx_training_epochs": 0}) == [
        "ext_mlx_training_epochs is 0, but must be at least 1 (OJS ML Extensions §5.1); "
        'use a positive integer, e.g. "ext_mlx_training_epochs": 3'
    ]


def test_integers_too_long_to_print_are_reported_rather_than_crashing_the_validator() -> None:
    huge = 10**5000
    attrs = {
        "ext_mlx_inference_batch_size": -huge,
        "ext_mlx_eval_thresholds": {"f1": {"min": huge, "max": 1}},
        "ext_mlx_preprocess_split_ratios": {"train": huge},
    }
    assert violations_of(attrs)[0] == (
        "ext_mlx_inference_batch_size is <int>, but must be at least 1 (OJS ML Extensions §5.2); "
        'use a positive integer, e.g. "ext_mlx_inference_batch_size": 64'
    )
    assert paths_of(attrs) == [
        "ext_mlx_inference_batch_size",
        "ext_mlx_eval_thresholds.f1",
        "ext_mlx_preprocess_split_ratios.train",
    ]


def test_every_violation_in_a_job_is_reported_at_once_in_job_order() -> None:
    attrs = {
        "ext_mlx_training_epochs": 0,
        "ext_mlx_model_name": "ok",
        "ext_mlx_inference_mode": "fast",
        "ext_mlx_eval_thresholds": {"f1": {"min": 2, "max": 1}, "loss": {}},
    }
    assert paths_of(attrs) == [
        "ext_mlx_training_epochs",
        "ext_mlx_inference_mode",
        "ext_mlx_eval_thresholds.f1",
        "ext_mlx_eval_thresholds.loss",
    ]


# -- §5.4 metrics and thresholds -------------------------------------------------------------


@pytest.mark.parametrize(
    "bounds", [{"min": 0.92}, {"max": 100}, {"min": 0.5, "max": 0.5}, {"min": -1, "max": 1e9}]
)
def test_a_threshold_with_min_and_or_max_numbers_is_accepted(bounds: dict[str, float]) -> None:
    attrs = {"ext_mlx_eval_thresholds": {"accuracy": bounds}}
    assert validate_mlx(attrs)[0] == attrs


@pytest.mark.parametrize(
    ("bounds", "path", "problem"),
    [
        ({}, "ext_mlx_eval_thresholds.accuracy", "sets neither min nor max"),
        ({"min": 0.9, "max": 0.5}, "ext_mlx_eval_thresholds.accuracy", "has min 0.9 greater"),
        ({"minimum": 0.9}, "ext_mlx_eval_thresholds.accuracy", 'has key(s) "minimum"'),
        ({"min": "0.9"}, "ext_mlx_eval_thresholds.accuracy.min", "not a finite number"),
        ({"max": True}, "ext_mlx_eval_thresholds.accuracy.max", "not a finite number"),
        ({"max": float("nan")}, "ext_mlx_eval_thresholds.accuracy.max", "not a finite number"),
        (0.92, "ext_mlx_eval_thresholds.accuracy", "not an object with min and/or max"),
    ],
)
def test_a_malformed_threshold_is_rejected_at_its_path(
    bounds: Any, path: str, problem: str
) -> None:
    with pytest.raises(SpecError) as info:
        validate_mlx({"ext_mlx_eval_thresholds": {"accuracy": bounds}})
    assert [v.path for v in info.value.violations] == [path]
    assert problem in info.value.violations[0].problem


def test_a_threshold_with_min_above_max_reads_as_a_teaching_message() -> None:
    assert violations_of({"ext_mlx_eval_thresholds": {"accuracy": {"min": 0.9, "max": 0.5}}}) == [
        "ext_mlx_eval_thresholds.accuracy has min 0.9 greater than max 0.5 "
        '(OJS ML Extensions §5.4); make min <= max, e.g. {"min": 0.5, "max": 0.9}'
    ]


def test_a_metric_name_with_dots_is_bracketed_in_the_path() -> None:
    assert paths_of({"ext_mlx_eval_thresholds": {"top.1": {}}}) == [
        'ext_mlx_eval_thresholds["top.1"]'
    ]


def test_metrics_must_be_non_empty_strings_and_each_bad_entry_is_named() -> None:
    attrs = {"ext_mlx_eval_metrics": ["accuracy", "", 3, "f1", None]}
    assert paths_of(attrs) == [
        "ext_mlx_eval_metrics[1]",
        "ext_mlx_eval_metrics[2]",
        "ext_mlx_eval_metrics[4]",
    ]


def test_a_threshold_for_a_metric_that_is_not_computed_gives_a_warning_not_an_error() -> None:
    attrs = {
        "ext_mlx_eval_metrics": ["accuracy"],
        "ext_mlx_eval_thresholds": {"accuracy": {"min": 0.9}, "f1": {"min": 0.8}},
    }
    assert validate_mlx(attrs)[1] == [
        'ext_mlx_eval_thresholds sets a threshold for "f1", which ext_mlx_eval_metrics '
        "does not list (§5.4); add it there or drop the threshold"
    ]


# -- §5.3 transformations --------------------------------------------------------------------


def test_transformations_need_a_type_and_an_optional_object_config() -> None:
    steps = [
        {"type": "filter", "config": {"column": "language"}, "note": "extra keys are fine"},
        {"type": "normalize"},
        {"config": {}},
        {"type": ""},
        {"type": "sample", "config": [0.1]},
        "tokenize",
    ]
    assert paths_of({"ext_mlx_preprocess_transformations": steps}) == [
        "ext_mlx_preprocess_transformations[2].type",
        "ext_mlx_preprocess_transformations[3].type",
        "ext_mlx_preprocess_transformations[4].config",
        "ext_mlx_preprocess_transformations[5]",
    ]


def test_a_transformation_without_a_type_reads_as_a_teaching_message() -> None:
    assert violations_of({"ext_mlx_preprocess_transformations": [{}]}) == [
        "ext_mlx_preprocess_transformations[0].type is missing; each transformation needs a "
        "type name (OJS ML Extensions §5.3); "
        'e.g. {"type": "deduplicate", "config": {"columns": ["text"]}}'
    ]


def test_a_credential_in_a_transformation_config_is_rejected() -> None:
    """§12.4: credentials MUST NOT appear in job envelope attributes."""
    steps = [
        {"type": "tokenize", "config": {"tokenizer": "meta-llama/Llama-3.1-8B", "token": "hf_x"}},
        {"type": "filter", "config": {"source": {"AWS-Secret-Access-Key": "abc"}}},
    ]
    assert paths_of({"ext_mlx_preprocess_transformations": steps}) == [
        "ext_mlx_preprocess_transformations[0].config.token",
        "ext_mlx_preprocess_transformations[1].config.source.AWS-Secret-Access-Key",
    ]


def test_tokenizer_settings_named_like_tokens_are_not_mistaken_for_credentials() -> None:
    config = {"tokenizer": "bert", "pad_token": "<pad>", "max_tokens": 512, "bos_token": "<s>"}
    attrs = {"ext_mlx_preprocess_transformations": [{"type": "tokenize", "config": config}]}
    assert validate_mlx(attrs)[0] == attrs


# -- §4.2 schemas ----------------------------------------------------------------------------


def test_an_input_schema_that_is_not_valid_json_schema_reports_the_jsonschema_message() -> None:
    assert violations_of({"ext_mlx_model_input_schema": {"type": "strin"}}) == [
        "ext_mlx_model_input_schema is not a valid JSON Schema: 'strin' is not valid under any "
        "of the given schemas (at $.type) (OJS ML Extensions §4.2); fix the schema, e.g. "
        '"ext_mlx_model_input_schema": {"type": "object", "properties": {"text": {"type": '
        '"string"}}}'
    ]


@pytest.mark.parametrize(
    "schema",
    [
        {"$schema": "https://example.com/my-draft", "type": "object"},
        {"$schema": 7},
        {"properties": {"x": {"minimum": "zero"}}},
        {"required": "text"},
    ],
)
def test_an_output_schema_that_jsonschema_cannot_check_is_rejected(schema: dict[str, Any]) -> None:
    assert paths_of({"ext_mlx_model_output_schema": schema}) == ["ext_mlx_model_output_schema"]


def test_a_schema_that_names_a_known_draft_is_checked_against_that_draft() -> None:
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object"}
    assert validate_mlx({"ext_mlx_model_input_schema": schema})[0] == {
        "ext_mlx_model_input_schema": schema
    }


# -- §6 and §12 URIs -------------------------------------------------------------------------

GOOD_URIS = [
    "s3://bucket/models/v1.0/model.safetensors",
    "gs://bucket/models/v1.0/",
    "az://container/models/v1.0/model.safetensors",
    "hdfs://cluster/models/v1.0/",
    "hdfs:///user/ml/data/",
    "mlflow://experiment-id/run-id/artifacts/model",
    "wandb://entity/project/run-id/model",
    "hf://meta-llama/Llama-3.1-8B",
    "hf://org/model@a1b2c3",
    "s3://bucket/a..b/c...d",
    "s3://bucket/key?versionId=3",
]


@pytest.mark.parametrize("uri", GOOD_URIS)
def test_uris_with_well_known_schemes_are_accepted(uri: str) -> None:
    """§6: artifact URIs MUST use standard URI schemes; the well-known ones pass.

    `file://` passes only under an allowed prefix (§12.1, tests/spec/test_artifact_uris.py).
    """
    assert validate_mlx({"ext_mlx_artifact_model_uri": uri}) == (
        {"ext_mlx_artifact_model_uri": uri},
        [],
    )


@pytest.mark.parametrize("attribute", URI_ATTRIBUTES)
def test_every_uri_attribute_rejects_a_scheme_outside_the_allow_list(attribute: str) -> None:
    """§12.1: backends MUST validate that artifact URIs use allowed schemes."""
    assert paths_of({attribute: "http://example.com/model.bin"}) == [attribute]


def test_a_disallowed_scheme_reads_as_a_teaching_message_listing_the_allowed_ones() -> None:
    """§12.1: backends MUST validate that artifact URIs use allowed schemes."""
    assert violations_of({"ext_mlx_inference_model_uri": "https://evil.example/model.bin"}) == [
        'ext_mlx_inference_model_uri uses scheme "https", which is not allowed (allowed: az, '
        "file, gs, hdfs, hf, mlflow, s3, wandb) (OJS ML Extensions §12.1); use an allowed "
        'scheme, e.g. "s3://bucket/models/v1.0/model.safetensors", or add it to '
        "app.conf.ojs_ml_artifact_schemes"
    ]


@pytest.mark.parametrize(
    ("uri", "section"),
    [
        ("/data/models/v1.0/", "§6"),
        ("models/v1.0", "§6"),
        ("C:\\models\\v1.0", "§12.1"),
        ("", "§6"),
        ("s3://bucket/models/../../etc/passwd", "§12.1"),
        ("s3://bucket/models/%2e%2e/secrets", "§12.1"),
        ("s3://bucket/models/%2E%2e/secrets", "§12.1"),
        ("s3://bucket/models/.%2e/secrets", "§12.1"),
        ("s3://bucket/models/%252e%252e/secrets", "§12.1"),
        ("s3://bucket/models\\..\\secrets", "§12.1"),
        ("file:///data/../etc/shadow", "§12.1"),
        ("file://fileserver/share/model.bin", "§12.1"),
        ("file:data/model.bin", "§12.1"),
        ("file:", "§12.1"),
        ("s3://AKIAIOSFODNN7:wJalrXUtnFEMI@bucket/model.bin", "§12.4"),
        ("s3://user@bucket/model.bin", "§12.4"),
        ("s3://bucket/model.bin?X-Amz-Signature=abc&X-Amz-Credential=AKIA", "§12.4"),
        ("az://container/model.bin?sv=2024&sig=abc", "§12.4"),
        ("s3://bucket/model bin", "§6"),
        ("s3://bucket/model.bin\n", "§6"),
        ("s3://bucket/\tmodel.bin", "§6"),
        ("s3://bucket/model%00.bin", "§6"),
        ("s3://bucket/mo\u200bdel.bin", "§6"),
        ("s3://[bucket/model.bin", "§6"),
    ],
)
def test_unsafe_or_malformed_uris_are_rejected_citing_the_rule_they_break(
    uri: str, section: str
) -> None:
    """§12.1: MUST NOT allow arbitrary file system access; §12.4: credentials MUST NOT appear."""
    with pytest.raises(SpecError) as info:
        validate_mlx({"ext_mlx_training_resume_from": uri})
    violations = info.value.violations
    assert {v.path for v in violations} == {"ext_mlx_training_resume_from"}
    assert f"OJS ML Extensions {section}" in {v.section for v in violations}


def test_embedded_credentials_read_as_a_teaching_message() -> None:
    """§12.4: credentials MUST NOT appear in job envelope attributes."""
    assert violations_of({"ext_mlx_training_dataset_uri": "s3://key:secret@bucket/train"}) == [
        "ext_mlx_training_dataset_uri embeds credentials (user info before @) "
        "(OJS ML Extensions §12.4); remove it; workers authenticate with an IAM role or "
        "workload identity instead"
    ]


def test_a_uri_scheme_is_normalised_to_lower_case() -> None:
    out, _ = validate_mlx({"ext_mlx_eval_model_uri": "S3://Bucket/Model"})
    assert out == {"ext_mlx_eval_model_uri": "s3://Bucket/Model"}


def test_callers_can_narrow_the_scheme_allow_list_per_queue_or_tenant() -> None:
    """§12.1: backends MUST validate allowed schemes (and SHOULD narrow them per tenant)."""
    attrs = {"ext_mlx_artifact_model_uri": "hf://org/model@main"}
    assert paths_of(attrs, uri_schemes=frozenset({"s3"})) == ["ext_mlx_artifact_model_uri"]
    assert validate_mlx(attrs, uri_schemes=DEFAULT_ARTIFACT_SCHEMES)[0] == attrs


def test_callers_can_widen_the_scheme_allow_list() -> None:
    attrs = {"ext_mlx_artifact_model_uri": "https://models.example/m.onnx"}
    assert validate_mlx(attrs, uri_schemes=DEFAULT_ARTIFACT_SCHEMES | {"HTTPS"})[0] == attrs


# -- forward compatibility and warnings ------------------------------------------------------


def test_an_unknown_ext_mlx_attribute_is_kept_with_a_warning_suggesting_the_near_name() -> None:
    out, warnings = validate_mlx({"ext_mlx_trainig_epochs": {"any": "thing"}})
    assert out == {"ext_mlx_trainig_epochs": {"any": "thing"}}
    assert warnings == [
        "ext_mlx_trainig_epochs is not defined by OJS ML Extensions v0.1 (§8); kept unchanged; "
        "did you mean ext_mlx_training_epochs?"
    ]


def test_an_unknown_ext_mlx_attribute_from_a_future_version_is_kept_without_a_guess() -> None:
    out, warnings = validate_mlx({"ext_mlx_quantum_qubits": 4})
    assert out == {"ext_mlx_quantum_qubits": 4}
    assert warnings == [
        "ext_mlx_quantum_qubits is not defined by OJS ML Extensions v0.1 (§8); kept unchanged"
    ]


def test_a_key_outside_the_ext_mlx_namespace_is_rejected() -> None:
    assert violations_of({"ext_ml_gpu_count": 1}) == [
        "ext_ml_gpu_count is not an ext_mlx_* attribute (OJS ML Extensions §8); pass only "
        'ext_mlx_* attributes here, e.g. "ext_mlx_model_name": "resnet50"'
    ]


def test_a_model_version_that_is_not_semver_gives_a_warning_not_an_error() -> None:
    out, warnings = validate_mlx({"ext_mlx_model_version": "v2"})
    assert out == {"ext_mlx_model_version": "v2"}
    assert warnings == ['ext_mlx_model_version "v2" is not a semantic version (§4), e.g. "2.1.0"']


def test_the_input_mapping_is_not_mutated() -> None:
    attrs = {"ext_mlx_eval_model_uri": "S3://b/m", "ext_mlx_eval_metrics": ["f1"]}
    out, _ = validate_mlx(attrs)
    assert attrs == {"ext_mlx_eval_model_uri": "S3://b/m", "ext_mlx_eval_metrics": ["f1"]}
    assert out is not attrs


# -- properties ------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text()
    | st.sampled_from(
        ["s3://b/k", "file:///x", "hf://o/m@r", "S3://b/%2e%2e", "pytorch", "batch", "2.1.0"]
    ),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
mlx_keys = st.sampled_from(sorted(KNOWN_ATTRIBUTES)) | st.text(max_size=12).map(
    lambda s: "ext_mlx_" + s
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(mlx_keys, json_values, max_size=6))
def test_arbitrary_json_values_raise_only_spec_error_and_valid_output_is_a_fixed_point(
    attrs: dict[str, Any],
) -> None:
    try:
        out, warnings = validate_mlx(attrs)
    except SpecError as exc:
        assert exc.violations
        return
    assert validate_mlx(out) == (out, warnings)
