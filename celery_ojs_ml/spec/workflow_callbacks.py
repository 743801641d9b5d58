"""A batch's callbacks (OJS Workflow Primitives §6): `on_complete`, `on_success`, `on_failure`.

Responsibility: validate a workflow's `callbacks` into jobs, or raise one
`SpecError` naming every problem (`callbacks.on_failure.ext_ml_gpu_count ...`).

Key decisions:
- Callbacks belong to a batch (§6.2): a chain or a group that declares any is
  refused rather than run without them. A batch that declares none (§6.2
  requires one) is accepted and runs as a group, which §6.2 says it is.
- Each callback is a job like any step (OJS ML §12.3): its own requirements,
  the workflow's metadata in its `meta`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.spec.envelope import Job

SECTION = "OJS Workflow Primitives §6.3"
NAMES = ("on_complete", "on_success", "on_failure")
"""The callbacks of §6.3, in the order they are described."""
_EXAMPLE = '"callbacks": {"on_success": {"type": "batch.report", "args": []}}'


def parse_callbacks(
    doc: Mapping[str, Any], kind: str, parse: Callable[[Any], Job]
) -> dict[str, Job]:
    """The workflow's callbacks by name, each parsed with `parse` (a step's parser)."""
    raw = doc.get("callbacks")
    if kind != "batch":
        if raw:  # an empty mapping or null says nothing
            problem = f"are a batch's, not a {kind}'s (OJS Workflow Primitives §6)"
            fix = 'use "workflow_type": "batch" with "jobs", or drop the callbacks'
            raise SpecError(Violation("callbacks", problem, SECTION, fix))
        return {}
    if raw is None or raw == {}:  # §6.2: then it is a group, and runs as one
        return {}
    if not isinstance(raw, Mapping):
        problem = f"is {raw!r:.60} but must map {', '.join(NAMES)} to jobs"
        raise SpecError(Violation("callbacks", problem, SECTION, f"e.g. {_EXAMPLE}"))
    violations = [
        Violation(f"callbacks.{name}", "is not a callback", SECTION, f"use one of {NAMES}")
        for name in raw
        if name not in NAMES
    ]
    found: dict[str, Job] = {}
    for name in (n for n in NAMES if n in raw):
        try:
            found[name] = parse(raw[name])
        except SpecError as exc:
            violations += exc.prefixed(f"callbacks.{name}").violations
    if violations:
        raise SpecError(violations)
    return found
