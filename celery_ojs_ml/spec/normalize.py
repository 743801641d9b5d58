"""Validate and normalise OJS ML v0.3 attributes into canonical requirements.

Key decision: validation collects every violation before raising, and each one
names the attribute path, the rule with its spec section, and a fix with a
correct example. Field rules come from the pydantic model; this module adds
the cross-field MUSTs, the SHOULDs we follow (inference and defaults), and the
§15 bounds. Normalising an already-normalised dict returns it unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.spec import rules
from celery_ojs_ml.spec.bounds import DEFAULT_BOUNDS as DEFAULT_BOUNDS
from celery_ojs_ml.spec.bounds import Bounds as Bounds
from celery_ojs_ml.spec.resources import KNOWN_KEYS, MLRequirements

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Normalized:
    """Canonical requirements plus the warnings produced on the way."""

    requirements: MLRequirements
    warnings: list[str] = field(default_factory=list)

    def flat(self) -> dict[str, Any]:
        """Flat `ext_ml_*` keys after defaults and inference."""
        return self.requirements.flat()


def normalize(attrs: Mapping[str, Any], bounds: Bounds = DEFAULT_BOUNDS) -> Normalized:
    """Validate `ext_ml_*` attributes and return the canonical form, or raise SpecError."""
    model = _parse(attrs)
    violations = rules.check(model, bounds)
    if violations:
        raise SpecError(violations)
    inferred = rules.infer(model)
    warnings = [
        f"{key} is not an OJS ML v0.3 attribute; kept as is (OJS ML §1.2 forward compatibility)"
        for key in attrs
        if key.startswith("ext_ml_") and key not in KNOWN_KEYS
    ]
    for message in warnings:
        log.info(message)
    return Normalized(inferred, warnings)


def _parse(attrs: Mapping[str, Any]) -> MLRequirements:
    try:
        return MLRequirements.model_validate(dict(attrs))
    except ValidationError as exc:
        raise SpecError([_violation(err) for err in exc.errors()]) from None


def _violation(err: Any) -> Violation:
    loc = err["loc"]
    path = _path(loc)
    top = str(loc[0]) if loc else ""
    return Violation(
        path,
        _problem(err),
        rules.section_of(top),
        rules.fix_for(top, path),
    )


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<job>"


def _problem(err: Any) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    if kind == "string_pattern_mismatch":
        return f"has an invalid format (expected pattern {ctx.get('pattern')})"
    if kind == "extra_forbidden":
        return "is not a known key"
    if kind == "missing":
        return "is required"
    message = str(err["msg"])
    return "is invalid: " + message[0].lower() + message[1:]
