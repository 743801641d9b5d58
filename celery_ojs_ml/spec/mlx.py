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
import json
import math
import re
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.spec import uris

__all__ = ["DEFAULT_ARTIFACT_SCHEMES", "KNOWN_ATTRIBUTES", "PREFIX", "validate_mlx"]

PREFIX = "ext_mlx_"
#: §6 well-known artifact URI schemes; callers may narrow them per queue or tenant (§12.1).
DEFAULT_ARTIFACT_SCHEMES = frozenset({"s3", "gs", "az", "hdfs", "mlflow", "wandb", "hf", "file"})
#: §5.3: the split ratios must add up to 1.0 within this tolerance.
SPLIT_TOLERANCE = 1e-6

MODEL_FRAMEWORKS = ("pytorch", "tensorflow", "onnx", "jax", "sklearn", "xgboost", "custom")
INFERENCE_MODES = ("batch", "streaming", "realtime")
DATA_FORMATS = ("csv", "parquet", "json", "jsonl", "tfrecord", "arrow", "custom")
ARTIFACT_REGISTRIES = ("s3", "gcs", "azure_blob", "mlflow", "wandb", "huggingface", "local")
GPU_AFFINITIES = ("spread", "pack", "dedicated")
PREEMPTION_POLICIES = ("never", "save_and_retry", "immediate")
SPOT_PREFERENCES = ("spot_preferred", "on_demand_only", "any")

#: Names of secrets; a config key or URI query parameter with one of them breaks §12.4.
_CREDENTIAL_NAMES = frozenset(
    {"password", "passwd", "secret", "client_secret", "private_key", "credentials"}
    | {"api_key", "apikey", "access_key", "access_key_id", "secret_key", "secret_access_key"}
    | {"token", "access_token", "auth_token", "session_token", "security_token", "sas_token"}
    | {"sig", "signature", "awsaccesskeyid", "x_amz_credential", "x_amz_signature"}
    | {"x_amz_security_token", "x_goog_credential", "x_goog_signature"}
)
# Suffixes, not substrings: tokenizer settings such as `pad_token` are not secrets.
_CREDENTIAL_SUFFIXES = ("_password", "_secret", "_secret_key", "_access_key", "_api_key")
_SEMVER = re.compile(r"\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")
_URI_EXAMPLE = '"s3://bucket/models/v1.0/model.safetensors"'
_RATIO_EXAMPLE = '{"train": 0.8, "validation": 0.1, "test": 0.1}'
_BOUNDS_EXAMPLE = '{"min": 0.92}'
_STEP_EXAMPLE = '{"type": "deduplicate", "config": {"columns": ["text"]}}'
_LOCAL = 'use a local absolute path, e.g. "file:///data/models/v1.0/"'
_NO_SECRETS = "remove it; workers authenticate with an IAM role or workload identity instead"
_SCHEMES_SETTING = "app.conf.ojs_ml_artifact_schemes"
_PREFIXES_SETTING = "app.conf.ojs_ml_artifact_prefixes"


@dataclass
class _Collector:
    """Violations and warnings gathered while one job is checked."""

    schemes: frozenset[str]
    prefixes: tuple[str, ...] = ()
    violations: list[Violation] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def fail(self, path: str, problem: str, section: str, fix: str) -> None:
        self.violations.append(Violation(path, problem, f"OJS ML Extensions {section}", fix))


Checker = Callable[[str, Any, _Collector], Any]


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
    collector = _Collector(frozenset(s.lower() for s in uri_schemes), tuple(uri_prefixes))
    out = {key: _check_attribute(key, value, collector) for key, value in attrs.items()}
    _warn_unmeasured_thresholds(out, collector)
    if collector.violations:
        raise SpecError(collector.violations)
    return out, collector.warnings


def _check_attribute(key: Any, value: Any, c: _Collector) -> Any:
    checker = _ATTRIBUTES.get(key)
    if checker is not None:
        return checker(key, value, c)
    if isinstance(key, str) and key.startswith(PREFIX):
        c.warnings.append(_unknown_attribute_warning(key))
    else:
        fix = 'pass only ext_mlx_* attributes here, e.g. "ext_mlx_model_name": "resnet50"'
        path = key if isinstance(key, str) else _show(key)
        c.fail(path, "is not an ext_mlx_* attribute", "§8", fix)
    return value


def _unknown_attribute_warning(key: str) -> str:
    warning = f"{key} is not defined by OJS ML Extensions v0.1 (§8); kept unchanged"
    close = difflib.get_close_matches(key, _ATTRIBUTES, n=1, cutoff=0.85)
    return f"{warning}; did you mean {close[0]}?" if close else warning


def _warn_unmeasured_thresholds(out: Mapping[str, Any], c: _Collector) -> None:
    metrics, thresholds = out.get("ext_mlx_eval_metrics"), out.get("ext_mlx_eval_thresholds")
    if not isinstance(metrics, list) or not isinstance(thresholds, Mapping):
        return
    for metric in thresholds:
        if metric not in metrics:
            c.warnings.append(
                f"ext_mlx_eval_thresholds sets a threshold for {_show(metric)}, which "
                "ext_mlx_eval_metrics does not list (§5.4); add it there or drop the threshold"
            )


# -- value helpers ---------------------------------------------------------------------------


def _show(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(value: Any) -> str:
    """The JSON kind and a short rendering, e.g. `a string ("3")`."""
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    kinds |= {list: "an array", tuple: "an array"}
    kind = "an object" if isinstance(value, Mapping) else kinds.get(type(value))
    return "null" if value is None else f"{kind or type(value).__name__} ({_show(value)})"


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> TypeGuard[float]:
    # Python ints never overflow, and math.isfinite would raise on huge ones.
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _is_name(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and bool(value.strip())


def _child(path: str, key: Any) -> str:
    plain = isinstance(key, str) and _PLAIN_KEY.fullmatch(key)
    return f"{path}.{key}" if plain else f"{path}[{_show(key)}]"


def _wrong_type(c: _Collector, path: str, value: Any, want: str, section: str, eg: str) -> None:
    c.fail(path, f"is {_describe(value)}, not {want}", section, f'use {want}, e.g. "{path}": {eg}')


# -- checker factories -----------------------------------------------------------------------


def _text(section: str, example: str) -> Checker:
    def check(path: str, value: Any, c: _Collector) -> Any:
        fix = f'give a non-empty string, e.g. "{path}": "{example}"'
        if not isinstance(value, str):
            _wrong_type(c, path, value, "a string", section, f'"{example}"')
        elif not value.strip():
            c.fail(path, "is blank", section, fix)
        return value

    return check


def _version(path: str, value: Any, c: _Collector) -> Any:
    _text("§4", "2.1.0")(path, value, c)
    if _is_name(value) and not _SEMVER.fullmatch(value):
        c.warnings.append(f'{path} {_show(value)} is not a semantic version (§4), e.g. "2.1.0"')
    return value


def _one_of(section: str, allowed: tuple[str, ...]) -> Checker:
    def check(path: str, value: Any, c: _Collector) -> Any:
        if not isinstance(value, str):
            _wrong_type(c, path, value, "a string", section, f'"{allowed[0]}"')
        elif value not in allowed:
            near = difflib.get_close_matches(value.lower(), allowed, n=1, cutoff=0.5)
            fix = f'use one of them, e.g. "{path}": "{(near or allowed)[0]}"'
            c.fail(path, f"is {_show(value)}, not one of {', '.join(allowed)}", section, fix)
        return value

    return check


def _positive_int(section: str, example: int) -> Checker:
    def check(path: str, value: Any, c: _Collector) -> Any:
        fix = f'use a positive integer, e.g. "{path}": {example}'
        if not _is_int(value):
            _wrong_type(c, path, value, "an integer", section, str(example))
        elif value < 1:
            c.fail(path, f"is {_show(value)}, but must be at least 1", section, fix)
        return value

    return check


def _opaque_object(path: str, value: Any, c: _Collector) -> Any:
    """§5.1: only the container is checked; the very same object is handed back."""
    if not isinstance(value, Mapping):
        _wrong_type(c, path, value, "an object", "§5.1", '{"learning_rate": 2e-5}')
    return value


def _json_schema(path: str, value: Any, c: _Collector) -> Any:
    eg = '{"type": "object", "properties": {"text": {"type": "string"}}}'
    if not isinstance(value, Mapping):
        _wrong_type(c, path, value, "an object holding a JSON Schema", "§4.2", eg)
    elif (problem := _schema_problem(dict(value))) is not None:
        fix = f'fix the schema, e.g. "{path}": {eg}'
        c.fail(path, f"is not a valid JSON Schema: {problem}", "§4.2", fix)
    return value


def _schema_problem(schema: dict[str, Any]) -> str | None:
    declared = schema.get("$schema")
    if "$schema" in schema and not isinstance(declared, str):
        return f"$schema is {_describe(declared)}, not a URI string"
    try:
        # An explicit default keeps jsonschema from silently swapping in its latest draft.
        cls = validator_for(schema, default=None) if declared else validator_for(schema)
        if cls is None:
            return f"$schema {_show(declared)} names no JSON Schema draft that jsonschema knows"
        cls.check_schema(schema)
    except SchemaError as exc:
        return f"{exc.message} (at {exc.json_path})"
    except ValueError as exc:
        return str(exc)
    return None


def _array_of(section: str, want: str, eg: str, item: Checker) -> Checker:
    def check(path: str, value: Any, c: _Collector) -> Any:
        if not isinstance(value, list | tuple):
            _wrong_type(c, path, value, want, section, eg)
            return value
        return [item(f"{path}[{i}]", entry, c) for i, entry in enumerate(value)]

    return check


def _metric(path: str, metric: Any, c: _Collector) -> Any:
    if not _is_name(metric):
        fix = 'name each metric with a non-empty string, e.g. "accuracy"'
        c.fail(path, f"is {_describe(metric)}, not a metric name", "§5.4", fix)
    return metric


def _thresholds(path: str, value: Any, c: _Collector) -> Any:
    if not isinstance(value, Mapping):
        _wrong_type(c, path, value, "an object", "§5.4", f'{{"accuracy": {_BOUNDS_EXAMPLE}}}')
        return value
    fix = f'key each threshold by a metric name, e.g. "accuracy": {_BOUNDS_EXAMPLE}'
    for metric, bounds in value.items():
        if not _is_name(metric):
            c.fail(_child(path, metric), "is not a metric name", "§5.4", fix)
        _check_bounds(_child(path, metric), bounds, c)
    return value


def _check_bounds(path: str, bounds: Any, c: _Collector) -> None:
    fix = f"give min and/or max as numbers, e.g. {_BOUNDS_EXAMPLE}"
    if not isinstance(bounds, Mapping):
        c.fail(path, f"is {_describe(bounds)}, not an object with min and/or max", "§5.4", fix)
        return
    extra = [_show(k) for k in bounds if k not in ("min", "max")]
    if extra:
        c.fail(path, f"has key(s) {', '.join(extra)}; only min and max are allowed", "§5.4", fix)
    elif "min" not in bounds and "max" not in bounds:
        c.fail(path, "sets neither min nor max", "§5.4", fix)
    for key in ("min", "max"):
        if key in bounds and not _is_number(bounds[key]):
            problem = f"is {_describe(bounds[key])}, not a finite number"
            c.fail(f"{path}.{key}", problem, "§5.4", f'use a number, e.g. "{key}": 0.92')
    low, high = bounds.get("min"), bounds.get("max")
    if _is_number(low) and _is_number(high) and low > high:
        fix = 'make min <= max, e.g. {"min": 0.5, "max": 0.9}'
        c.fail(path, f"has min {_show(low)} greater than max {_show(high)}", "§5.4", fix)


def _transformation(path: str, step: Any, c: _Collector) -> Any:
    fix = f"e.g. {_STEP_EXAMPLE}"
    if not isinstance(step, Mapping):
        c.fail(path, f"is {_describe(step)}, not a transformation object", "§5.3", fix)
        return step
    if not _is_name(step.get("type")):
        problem = f"is {_describe(step['type'])}" if "type" in step else "is missing"
        c.fail(f"{path}.type", f"{problem}; each transformation needs a type name", "§5.3", fix)
    config = step.get("config", {})
    if isinstance(config, Mapping):
        _reject_credentials(f"{path}.config", config, c)
    else:
        c.fail(f"{path}.config", f"is {_describe(config)}, not an object", "§5.3", fix)
    return step


def _reject_credentials(path: str, value: Any, c: _Collector) -> None:
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _reject_credentials(f"{path}[{i}]", item, c)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if _is_credential_name(key):
                c.fail(_child(path, key), "holds a credential", "§12.4", _NO_SECRETS)
            _reject_credentials(_child(path, key), item, c)


def _is_credential_name(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    name = name.lower().replace("-", "_")
    return name in _CREDENTIAL_NAMES or name.endswith(_CREDENTIAL_SUFFIXES)


def _split_ratios(path: str, value: Any, c: _Collector) -> Any:
    if not isinstance(value, Mapping):
        _wrong_type(c, path, value, "an object", "§5.3", _RATIO_EXAMPLE)
        return value
    fix = f"e.g. {_RATIO_EXAMPLE}"
    valid = True
    for name, ratio in value.items():
        if not _is_name(name):
            c.fail(_child(path, name), "is not a split name", "§5.3", fix)
        if not _is_number(ratio) or not 0 <= ratio <= 1:
            problem = f"is {_describe(ratio)}, not a number from 0 to 1"
            c.fail(_child(path, name), problem, "§5.3", fix)
            valid = False
    total = math.fsum(value.values()) if valid else 1.0
    if abs(total - 1.0) > SPLIT_TOLERANCE:
        fix = f"make the ratios add up to 1.0, e.g. {_RATIO_EXAMPLE}"
        c.fail(path, f"sum to {total:.10g}, not 1.0", "§5.3", fix)
    return value


# -- URIs (§6, §12.1, §12.4) -----------------------------------------------------------------


def _uri(section: str) -> Checker:
    def check(path: str, value: Any, c: _Collector) -> Any:
        if not isinstance(value, str):
            _wrong_type(c, path, value, "a URI string", section, _URI_EXAMPLE)
            return value
        return _check_uri(path, value, c)

    return check


def _check_uri(path: str, uri: str, c: _Collector) -> str:
    parts, problem = _parse_uri(uri)
    if parts is None:
        c.fail(path, problem, "§6", f"write an absolute URI, e.g. {_URI_EXAMPLE}")
        return uri
    scheme = parts.scheme.lower()
    normalised = scheme + uri[len(parts.scheme) :]
    allowed = scheme in c.schemes
    if not allowed:
        names = ", ".join(sorted(c.schemes)) or "none"
        problem = f"uses scheme {_show(scheme)}, which is not allowed (allowed: {names})"
        fix = f"use an allowed scheme, e.g. {_URI_EXAMPLE}, or add it to {_SCHEMES_SETTING}"
        c.fail(path, problem, "§12.1", fix)
    unsafe = list(_uri_safety_problems(parts, scheme))
    for problem, section, fix in unsafe:
        c.fail(path, problem, section, fix)
    if allowed and not unsafe:
        _check_reach(path, normalised, c)
    return normalised


def _check_reach(path: str, uri: str, c: _Collector) -> None:
    """§12.1: no arbitrary file system access, and no internal hosts, unless a prefix allows."""
    problem = uris.artifact_reach_problem(uri, c.prefixes)
    if problem is None:
        return
    if c.prefixes:
        fix = f"use a URI under one of {list(c.prefixes)}, or add its prefix to {_PREFIXES_SETTING}"
    else:
        parts = urlsplit(uri)
        local = parts.scheme == "file"
        kind = "an object-store URI" if local else "a public storage URI"
        grant = "file:///data/artifacts/" if local else f"{parts.scheme}://{parts.netloc}/"
        fix = (
            f'use {kind}, e.g. {_URI_EXAMPLE}, or allow it with {_PREFIXES_SETTING} = ["{grant}"] '
            "(every artifact URI must then be under a listed prefix)"
        )
    c.fail(path, f"{uri!r} {problem}", "§12.1", fix)


def _parse_uri(uri: str) -> tuple[SplitResult | None, str]:
    bad = next((ch for ch in uri + _decoded(uri) if _is_unsafe_char(ch)), None)
    if bad is not None:
        return None, f"contains whitespace or control character {_show(bad)}"
    try:
        parts = urlsplit(uri)
    except ValueError as exc:
        return None, f"is not a valid URI ({exc})"
    return (parts, "") if parts.scheme else (None, f"{_show(uri)} has no scheme")


def _is_unsafe_char(ch: str) -> bool:
    return ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf", "Cs")


def _decoded(text: str) -> str:
    """Undo percent-encoding until stable, so `%252e%252e` is seen as `..` too."""
    for _ in range(4):
        text, previous = unquote(text), text
        if text == previous:
            break
    return text


def _uri_safety_problems(parts: SplitResult, scheme: str) -> Iterator[tuple[str, str, str]]:
    if "@" in parts.netloc:
        yield "embeds credentials (user info before @)", "§12.4", _NO_SECRETS
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        if _is_credential_name(name):
            yield f"carries credential query parameter {_show(name)}", "§12.4", _NO_SECRETS
    if ".." in re.split(r"[/\\]", _decoded(parts.netloc + parts.path)):
        yield "has a '..' segment (path traversal)", "§12.1", f"drop it, e.g. {_URI_EXAMPLE}"
    if scheme == "file" and parts.netloc.lower() not in ("", "localhost"):
        yield f"names host {_show(parts.netloc)}; file URIs must be local", "§12.1", _LOCAL
    if scheme == "file" and not parts.path.startswith("/"):
        yield "is not an absolute file path", "§12.1", _LOCAL


_ATTRIBUTES: dict[str, Checker] = {
    # §4 model metadata
    "ext_mlx_model_name": _text("§4", "resnet50-imagenet"),
    "ext_mlx_model_version": _version,
    "ext_mlx_model_framework": _one_of("§4.1", MODEL_FRAMEWORKS),
    "ext_mlx_model_input_schema": _json_schema,
    "ext_mlx_model_output_schema": _json_schema,
    "ext_mlx_experiment_id": _text("§4", "exp-llama-finetune-2024"),
    "ext_mlx_run_id": _text("§4", "run-001"),
    # §5.1 training
    "ext_mlx_training_dataset_uri": _uri("§5.1"),
    "ext_mlx_training_validation_uri": _uri("§5.1"),
    "ext_mlx_training_hyperparameters": _opaque_object,
    "ext_mlx_training_epochs": _positive_int("§5.1", 3),
    "ext_mlx_training_checkpoint_uri": _uri("§5.1"),
    "ext_mlx_training_resume_from": _uri("§5.1"),
    "ext_mlx_training_output_model_uri": _uri("§5.1"),
    # §5.2 inference
    "ext_mlx_inference_model_uri": _uri("§5.2"),
    "ext_mlx_inference_batch_size": _positive_int("§5.2", 64),
    "ext_mlx_inference_timeout_ms": _positive_int("§5.2", 5000),
    "ext_mlx_inference_input_uri": _uri("§5.2"),
    "ext_mlx_inference_output_uri": _uri("§5.2"),
    "ext_mlx_inference_mode": _one_of("§5.2", INFERENCE_MODES),
    # §5.3 preprocessing
    "ext_mlx_preprocess_input_uri": _uri("§5.3"),
    "ext_mlx_preprocess_output_uri": _uri("§5.3"),
    "ext_mlx_preprocess_input_format": _one_of("§5.3", DATA_FORMATS),
    "ext_mlx_preprocess_output_format": _one_of("§5.3", DATA_FORMATS),
    "ext_mlx_preprocess_transformations": _array_of(
        "§5.3", "an array of transformation objects", f"[{_STEP_EXAMPLE}]", _transformation
    ),
    "ext_mlx_preprocess_split_ratios": _split_ratios,
    # §5.4 evaluation
    "ext_mlx_eval_dataset_uri": _uri("§5.4"),
    "ext_mlx_eval_model_uri": _uri("§5.4"),
    "ext_mlx_eval_metrics": _array_of("§5.4", "an array of metric names", '["f1"]', _metric),
    "ext_mlx_eval_thresholds": _thresholds,
    "ext_mlx_eval_output_uri": _uri("§5.4"),
    "ext_mlx_eval_baseline_run_id": _text("§5.4", "run-000"),
    # §6 artifacts
    "ext_mlx_artifact_model_uri": _uri("§6"),
    "ext_mlx_artifact_dataset_uri": _uri("§6"),
    "ext_mlx_artifact_checkpoint_uri": _uri("§6"),
    "ext_mlx_artifact_output_uri": _uri("§6"),
    "ext_mlx_artifact_registry": _one_of("§6", ARTIFACT_REGISTRIES),
    # §7 scheduling hints
    "ext_mlx_scheduling_gpu_affinity": _one_of("§7.1", GPU_AFFINITIES),
    "ext_mlx_scheduling_preemption_policy": _one_of("§7", PREEMPTION_POLICIES),
    "ext_mlx_scheduling_spot_preference": _one_of("§7", SPOT_PREFERENCES),
    "ext_mlx_scheduling_data_locality": _uri("§7.2"),
}

#: Every attribute that OJS ML Extensions v0.1 defines (§8).
KNOWN_ATTRIBUTES = frozenset(_ATTRIBUTES)
