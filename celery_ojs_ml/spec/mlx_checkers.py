"""The `ext_mlx_*` value checkers (OJS ML Extensions v0.1 §4–§5) and what they share.

Each checker takes `(path, value, collector)`, reports every problem into the
`Collector` and hands the value back, so `validate_mlx` (`spec/mlx.py`) can
map each attribute to one checker and list every violation at once.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from celery_ojs_ml.errors import Violation

#: §5.3: the split ratios must add up to 1.0 within this tolerance.
SPLIT_TOLERANCE = 1e-6

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
_RATIO_EXAMPLE = '{"train": 0.8, "validation": 0.1, "test": 0.1}'
_BOUNDS_EXAMPLE = '{"min": 0.92}'
STEP_EXAMPLE = '{"type": "deduplicate", "config": {"columns": ["text"]}}'
NO_SECRETS = "remove it; workers authenticate with an IAM role or workload identity instead"


@dataclass
class Collector:
    """Violations and warnings gathered while one job is checked."""

    schemes: frozenset[str]
    prefixes: tuple[str, ...] = ()
    violations: list[Violation] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def fail(self, path: str, problem: str, section: str, fix: str) -> None:
        self.violations.append(Violation(path, problem, f"OJS ML Extensions {section}", fix))


Checker = Callable[[str, Any, Collector], Any]


# -- value helpers ---------------------------------------------------------------------------


def show(value: Any, limit: int = 60) -> str:
    """A value as JSON, cut to `limit` characters."""
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
    return "null" if value is None else f"{kind or type(value).__name__} ({show(value)})"


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> TypeGuard[float]:
    # Python ints never overflow, and math.isfinite would raise on huge ones.
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _is_name(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and bool(value.strip())


def _child(path: str, key: Any) -> str:
    plain = isinstance(key, str) and _PLAIN_KEY.fullmatch(key)
    return f"{path}.{key}" if plain else f"{path}[{show(key)}]"


def wrong_type(c: Collector, path: str, value: Any, want: str, section: str, eg: str) -> None:
    """Report that `value` is not of the JSON kind `want`, with an example."""
    c.fail(path, f"is {_describe(value)}, not {want}", section, f'use {want}, e.g. "{path}": {eg}')


# -- checker factories -----------------------------------------------------------------------


def text(section: str, example: str) -> Checker:
    def check(path: str, value: Any, c: Collector) -> Any:
        fix = f'give a non-empty string, e.g. "{path}": "{example}"'
        if not isinstance(value, str):
            wrong_type(c, path, value, "a string", section, f'"{example}"')
        elif not value.strip():
            c.fail(path, "is blank", section, fix)
        return value

    return check


def version(path: str, value: Any, c: Collector) -> Any:
    text("§4", "2.1.0")(path, value, c)
    if _is_name(value) and not _SEMVER.fullmatch(value):
        c.warnings.append(f'{path} {show(value)} is not a semantic version (§4), e.g. "2.1.0"')
    return value


def one_of(section: str, allowed: tuple[str, ...]) -> Checker:
    def check(path: str, value: Any, c: Collector) -> Any:
        if not isinstance(value, str):
            wrong_type(c, path, value, "a string", section, f'"{allowed[0]}"')
        elif value not in allowed:
            near = difflib.get_close_matches(value.lower(), allowed, n=1, cutoff=0.5)
            fix = f'use one of them, e.g. "{path}": "{(near or allowed)[0]}"'
            c.fail(path, f"is {show(value)}, not one of {', '.join(allowed)}", section, fix)
        return value

    return check


def positive_int(section: str, example: int) -> Checker:
    def check(path: str, value: Any, c: Collector) -> Any:
        fix = f'use a positive integer, e.g. "{path}": {example}'
        if not _is_int(value):
            wrong_type(c, path, value, "an integer", section, str(example))
        elif value < 1:
            c.fail(path, f"is {show(value)}, but must be at least 1", section, fix)
        return value

    return check


def opaque_object(path: str, value: Any, c: Collector) -> Any:
    """§5.1: only the container is checked; the very same object is handed back."""
    if not isinstance(value, Mapping):
        wrong_type(c, path, value, "an object", "§5.1", '{"learning_rate": 2e-5}')
    return value


def json_schema(path: str, value: Any, c: Collector) -> Any:
    eg = '{"type": "object", "properties": {"text": {"type": "string"}}}'
    if not isinstance(value, Mapping):
        wrong_type(c, path, value, "an object holding a JSON Schema", "§4.2", eg)
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
            return f"$schema {show(declared)} names no JSON Schema draft that jsonschema knows"
        cls.check_schema(schema)
    except SchemaError as exc:
        return f"{exc.message} (at {exc.json_path})"
    except ValueError as exc:
        return str(exc)
    return None


def array_of(section: str, want: str, eg: str, item: Checker) -> Checker:
    def check(path: str, value: Any, c: Collector) -> Any:
        if not isinstance(value, list | tuple):
            wrong_type(c, path, value, want, section, eg)
            return value
        return [item(f"{path}[{i}]", entry, c) for i, entry in enumerate(value)]

    return check


def metric_name(path: str, metric: Any, c: Collector) -> Any:
    if not _is_name(metric):
        fix = 'name each metric with a non-empty string, e.g. "accuracy"'
        c.fail(path, f"is {_describe(metric)}, not a metric name", "§5.4", fix)
    return metric


def metric_thresholds(path: str, value: Any, c: Collector) -> Any:
    if not isinstance(value, Mapping):
        wrong_type(c, path, value, "an object", "§5.4", f'{{"accuracy": {_BOUNDS_EXAMPLE}}}')
        return value
    fix = f'key each threshold by a metric name, e.g. "accuracy": {_BOUNDS_EXAMPLE}'
    for metric, bounds in value.items():
        if not _is_name(metric):
            c.fail(_child(path, metric), "is not a metric name", "§5.4", fix)
        _check_bounds(_child(path, metric), bounds, c)
    return value


def _check_bounds(path: str, bounds: Any, c: Collector) -> None:
    fix = f"give min and/or max as numbers, e.g. {_BOUNDS_EXAMPLE}"
    if not isinstance(bounds, Mapping):
        c.fail(path, f"is {_describe(bounds)}, not an object with min and/or max", "§5.4", fix)
        return
    extra = [show(k) for k in bounds if k not in ("min", "max")]
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
        c.fail(path, f"has min {show(low)} greater than max {show(high)}", "§5.4", fix)


def transformation(path: str, step: Any, c: Collector) -> Any:
    fix = f"e.g. {STEP_EXAMPLE}"
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


def _reject_credentials(path: str, value: Any, c: Collector) -> None:
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _reject_credentials(f"{path}[{i}]", item, c)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if is_credential_name(key):
                c.fail(_child(path, key), "holds a credential", "§12.4", NO_SECRETS)
            _reject_credentials(_child(path, key), item, c)


def is_credential_name(name: Any) -> bool:
    """Whether a config key or query parameter names a secret (§12.4)."""
    if not isinstance(name, str):
        return False
    name = name.lower().replace("-", "_")
    return name in _CREDENTIAL_NAMES or name.endswith(_CREDENTIAL_SUFFIXES)


def split_ratios(path: str, value: Any, c: Collector) -> Any:
    if not isinstance(value, Mapping):
        wrong_type(c, path, value, "an object", "§5.3", _RATIO_EXAMPLE)
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
