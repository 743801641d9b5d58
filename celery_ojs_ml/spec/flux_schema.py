"""The RFC 25 JSON Schema pass: turn each schema error into a teaching `Violation`.

Key decision: a `oneOf` error (a resource vertex) is reported through the one
branch whose vertex `type` matched, so the message is about the vertex the
author meant; only when no branch matches is the `type` itself reported.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import resources
from typing import Any

from jsonschema import Draft7Validator
from jsonschema.exceptions import ValidationError

from celery_ojs_ml.errors import Violation
from celery_ojs_ml.spec.flux_wording import (
    CORE_EXAMPLE,
    DOCUMENT,
    SCHEMA,
    SLOT_EXAMPLE,
    TASK_EXAMPLE,
    describe,
    show,
)

# Examples shown in fixes, looked up by the path with indices blanked, then by its last key.
_EXAMPLES = {
    "version": '"version": 1',
    "resources": f'"resources": [{SLOT_EXAMPLE}]',
    "resources[]": SLOT_EXAMPLE,
    "resources[].type": '"type": "slot" (or "node" holding one slot)',
    "resources[].with[]": f"{SLOT_EXAMPLE} under a node, {CORE_EXAMPLE} under a slot",
    "resources[].with[].type": '"type": "slot" under a node, "type": "core" under a slot',
    "resources[].with[].with[]": CORE_EXAMPLE,
    "type": '"type": "core"',
    "count": '"count": 2',
    "label": '"label": "default"',
    "with": f'"with": [{CORE_EXAMPLE}]',
    "tasks": f'"tasks": [{TASK_EXAMPLE}]',
    "tasks[]": TASK_EXAMPLE,
    "tasks[].count": '"count": {"per_slot": 1}',
    "command": '"command": ["app", "--verbose"]',
    "slot": '"slot": "default"',
    "per_slot": '"per_slot": 1',
    "total": '"total": 5',
    "attributes": '"attributes": {"system": {"duration": 3600}}',
    "system": '"system": {"duration": 3600}',
    "duration": '"duration": 3600',
    "cwd": '"cwd": "/home/flux"',
    "environment": '"environment": {"HOME": "/home/flux"}',
}
_TYPE_WORDS = {"object": "a mapping", "array": "a list", "integer": "an integer", "null": "null"}


@cache
def _validator() -> Draft7Validator:
    text = resources.files("celery_ojs_ml.spec").joinpath("data/jobspec_v1.schema.json")
    return Draft7Validator(json.loads(text.read_text(encoding="utf-8")))


def schema_violations(doc: dict[str, Any]) -> list[Violation]:
    """What the packaged RFC 25 JSON Schema finds wrong with `doc`, in teaching words."""
    return [v for error in _validator().iter_errors(doc) for v in _convert(error)]


def _convert(error: ValidationError) -> list[Violation]:
    path = _format_path(error.absolute_path)
    if error.validator == "oneOf":
        return _convert_one_of(error, path)
    if error.validator == "required":
        missing = [key for key in error.validator_value if key not in error.instance]
        return [_missing(_join(path, key)) for key in missing]
    if error.validator == "additionalProperties":
        allowed = list(error.schema.get("properties", {}))
        extra = [key for key in error.instance if key not in allowed]
        fix = f"remove it; allowed keys here are {', '.join(allowed)}"
        return [Violation(_join(path, key), "is not allowed here", SCHEMA, fix) for key in extra]
    return [Violation(path, _problem(error), SCHEMA, f"write it as e.g. {_example(path)}")]


def _convert_one_of(error: ValidationError, path: str) -> list[Violation]:
    """Report the errors of the branch whose vertex `type` matched, else the type itself."""
    branches: dict[Any, list[ValidationError]] = {}
    for sub in error.context or []:
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    typed = [errs for errs in branches.values() if not any(map(_is_type_mismatch, errs))]
    if len(typed) == 1:
        return [v for sub in typed[0] for v in _convert(sub)]
    if not isinstance(error.instance, Mapping):
        problem = f"is {show(error.instance)} but must be a resource vertex mapping"
        return [Violation(path, problem, SCHEMA, f"e.g. {_example(path)}")]
    type_path = _join(path, "type")
    problem = f"{describe(error.instance, 'type')} but is not a vertex type allowed here"
    return [Violation(type_path, problem, SCHEMA, f"e.g. {_example(type_path)}")]


def _is_type_mismatch(error: ValidationError) -> bool:
    where = list(error.relative_path)
    return where == ["type"] or (not where and error.validator == "type")


def _problem(error: ValidationError) -> str:
    value, limit, shown = error.validator_value, error.validator, show(error.instance)
    if limit == "type":
        wanted = [value] if isinstance(value, str) else value
        return f"is {shown} but must be {' or '.join(_TYPE_WORDS.get(t, f'a {t}') for t in wanted)}"
    if limit == "enum":
        return f"is {shown} but must be one of {', '.join(show(v) for v in value)}"
    if limit == "minimum":
        return f"is {shown} but must be >= {value}"
    if limit == "minItems":
        return f"has {len(error.instance)} elements but needs at least {value}"
    if limit == "maxItems":
        return f"has {len(error.instance)} elements but allows at most {value}"
    return str(error.message)


def _missing(path: str) -> Violation:
    return Violation(path, "is missing", SCHEMA, f"add it, e.g. {_example(path)}")


def _example(path: str) -> str:
    pattern = re.sub(r"\[\d+\]", "[]", path)
    last = pattern.rsplit(".", 1)[-1]
    default = "compare with the Example Jobspec in Flux RFC 25"
    return _EXAMPLES.get(pattern) or _EXAMPLES.get(last) or default


def _format_path(parts: Iterable[Any]) -> str:
    path = ""
    for part in parts:
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path or DOCUMENT, part)
    return path or DOCUMENT


def _join(path: str, key: Any) -> str:
    return str(key) if path == DOCUMENT else f"{path}.{key}"
