"""Parse one OJS job envelope, in either form, into a validated `Job`.

Key decision: an envelope is split by prefix. `ext_ml_*` keys (plus the v0.1
`meta` blocks, translated) become canonical requirements, `ext_mlx_*` keys go
to the ML Extensions validator, and everything else is the core envelope,
passed through untouched. Violations from all parts are reported together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.spec import legacy
from celery_ojs_ml.spec.mlx import validate_mlx
from celery_ojs_ml.spec.normalize import DEFAULT_BOUNDS, Bounds, normalize
from celery_ojs_ml.spec.policy import QueuePolicy, apply_defaults, limit_violations
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share, is_requirement_key
from celery_ojs_ml.spec.sharing import share_vs_mlx


@dataclass(slots=True)
class Job:
    """A validated OJS job: core envelope fields, requirements and ML metadata."""

    type: str | None
    requirements: MLRequirements
    mlx: dict[str, Any] = field(default_factory=dict)
    id: str | None = None
    queue: str | None = None
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    last_checkpoint: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)

    def canonical(self) -> dict[str, Any]:
        """Flat canonical `ext_ml_*` (then `ext_mlx_*`) keys after defaults and inference."""
        return {**self.requirements.flat(), **self.mlx}


@dataclass(frozen=True, slots=True)
class ParseOptions:
    """What validation enforces beyond the spec itself: bounds and queue policies."""

    bounds: Bounds = DEFAULT_BOUNDS
    policies: Mapping[str, QueuePolicy] = field(default_factory=dict)
    require_type: bool = True


DEFAULT_OPTIONS = ParseOptions()
_ID = "019502a4-0001-7abc-8000-000000000001"
"""An example job id (a UUIDv7, as OJS core ids are) for the fix of a bad one."""


def split_attrs(doc: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The requirement keys (`ext_ml_*`, `PROJECT_KEYS`) and `ext_mlx_*` keys of a mapping."""
    ml: dict[str, Any] = {}
    mlx: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(key, str) and key.startswith("ext_mlx_"):  # YAML allows non-string keys
            mlx[key] = value
        elif is_requirement_key(key):
            ml[key] = value
    return ml, mlx


def requirements_of(
    doc: Mapping[str, Any], queue: str | None = None, options: ParseOptions = DEFAULT_OPTIONS
) -> tuple[MLRequirements, dict[str, Any], list[str]]:
    """Validate the ML parts of a mapping: requirements, mlx metadata, warnings."""
    violations: list[Violation] = []
    warnings: list[str] = []
    ml, mlx_attrs = split_attrs(doc)
    meta = doc.get("meta")
    legacy_attrs: dict[str, Any] = {}
    try:
        if legacy.has_legacy(meta):
            legacy_attrs = legacy.from_meta(meta)  # type: ignore[arg-type]
        ml = legacy.merge(legacy_attrs, ml)
    except SpecError as exc:
        violations += exc.violations
    policy = options.policies.get(queue) if queue else None
    req = _requirements(apply_defaults(ml, policy), legacy_attrs, options, violations, warnings)
    if req is not None and queue is not None:
        violations += limit_violations(req, queue, policy)
    mlx = _mlx(mlx_attrs, options.bounds, violations, warnings)
    if req is not None and gpu_share(req) is not None:
        violations += share_vs_mlx(mlx)
    if violations:
        raise SpecError(violations)
    assert req is not None
    return req, mlx, warnings


def _requirements(
    ml: dict[str, Any],
    legacy_attrs: dict[str, Any],
    options: ParseOptions,
    violations: list[Violation],
    warnings: list[str],
) -> MLRequirements | None:
    try:
        result = normalize(ml, options.bounds)
    except SpecError as exc:
        violations += legacy.relabel(exc, legacy_attrs).violations
        return None
    warnings += result.warnings
    return result.requirements


def _mlx(
    attrs: dict[str, Any], bounds: Bounds, violations: list[Violation], warnings: list[str]
) -> dict[str, Any]:
    if not attrs:
        return {}
    try:
        schemes, prefixes = bounds.artifact_schemes, bounds.artifact_prefixes
        out, extra = validate_mlx(attrs, uri_schemes=schemes, uri_prefixes=prefixes)
    except SpecError as exc:
        violations += exc.violations
        return {}
    warnings += extra
    return out


def parse_job(doc: Any, options: ParseOptions = DEFAULT_OPTIONS) -> Job:
    """Validate one OJS envelope (v0.3 `ext_ml_*` and/or v0.1 `meta` form)."""
    if not isinstance(doc, Mapping):
        raise SpecError(
            Violation(
                "<job>",
                "must be a JSON object",
                "OJS core",
                'write an envelope, e.g. {"type": "ml.train", "args": []}',
            )
        )
    core = _core_violations(doc, options)
    queue = doc.get("queue") if isinstance(doc.get("queue"), str) else None
    try:
        req, mlx, warnings = requirements_of(doc, queue, options)
    except SpecError as exc:
        raise SpecError(core + exc.violations) from None
    if core:
        raise SpecError(core)
    meta = dict(doc.get("meta") or {})
    return Job(
        type=doc.get("type"),
        requirements=req,
        mlx=mlx,
        id=doc.get("id"),
        queue=queue,
        args=list(doc.get("args") or []),
        kwargs=dict(doc.get("kwargs") or {}),
        meta=meta,
        last_checkpoint=doc.get("last_checkpoint") or meta.get("last_checkpoint"),
        warnings=warnings,
    )


def _core_violations(doc: Mapping[str, Any], options: ParseOptions) -> list[Violation]:
    out = []
    kind = doc.get("type")
    if kind is None and options.require_type:
        out.append(
            Violation(
                "type", "is required", "OJS core", 'name the task to run, e.g. "type": "ml.train"'
            )
        )
    elif kind is not None and (not isinstance(kind, str) or not kind):
        out.append(
            Violation("type", "must be a non-empty string", "OJS core", 'e.g. "type": "ml.train"')
        )
    for key, kind_name, example in (
        ("args", list, '"args": []'),
        ("meta", dict, '"meta": {}'),
        ("kwargs", dict, '"kwargs": {}'),
    ):
        if doc.get(key) is not None and not isinstance(doc[key], kind_name):
            out.append(
                Violation(
                    key,
                    f"must be a JSON {'array' if kind_name is list else 'object'}",
                    "OJS core",
                    f"e.g. {example}",
                )
            )
    if doc.get("queue") is not None and not isinstance(doc["queue"], str):
        out.append(Violation("queue", "must be a string", "OJS core", 'e.g. "queue": "gpu"'))
    if doc.get("id") is not None and not (isinstance(doc["id"], str) and doc["id"]):
        out.append(Violation("id", "must be a non-empty string", "OJS core", f'e.g. "id": "{_ID}"'))
    return out
