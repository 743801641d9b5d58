"""OJS workflows (chain, group, batch) whose steps carry ML requirements.

Key decision: each step is validated as an independent job and inherits no
resource attributes from its siblings (OJS ML §12.3); only workflow metadata
(`meta`, `id`, `name`) propagates, into each step's `meta` under
`workflow`, with the step's own meta keys winning (§14.5).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.spec.envelope import DEFAULT_OPTIONS, Job, ParseOptions, parse_job
from celery_ojs_ml.spec.workflow_callbacks import parse_callbacks

STEP_KEYS = {"chain": "steps", "group": "jobs", "batch": "jobs"}
_SECTION = "OJS ML §12"


@dataclass(slots=True)
class Workflow:
    """A validated workflow: its kind, its steps as jobs, and shared metadata."""

    workflow_type: str
    steps: list[Job]
    id: str | None = None
    name: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Job] = field(default_factory=dict)
    """A batch's callbacks by name (`spec.workflow_callbacks`), each a job like any step."""


def is_workflow(doc: Any) -> bool:
    """Whether a document is an OJS workflow rather than a single job."""
    return isinstance(doc, Mapping) and "workflow_type" in doc


def parse_workflow(doc: Mapping[str, Any], options: ParseOptions = DEFAULT_OPTIONS) -> Workflow:
    """Validate every step independently; raise one SpecError with all step violations."""
    kind = doc.get("workflow_type")
    if not isinstance(kind, str) or kind not in STEP_KEYS:  # a list or dict is unhashable
        raise SpecError(
            Violation(
                "workflow_type",
                f"is {kind!r}; must be chain, group or batch",
                _SECTION,
                'e.g. "workflow_type": "chain"',
            )
        )
    key = STEP_KEYS[str(kind)]
    raw = doc.get(key)
    if not isinstance(raw, list) or not raw:
        raise SpecError(
            Violation(
                key,
                f"must be a non-empty array of jobs for a {kind}",
                _SECTION,
                f'e.g. "{key}": [{{"type": "ml.train"}}]',
            )
        )
    shared = _shared_meta(doc)
    steps, violations = [], []
    for i, step in enumerate(raw):
        try:
            steps.append(_step(step, shared, options))
        except SpecError as exc:
            violations += exc.prefixed(f"{key}[{i}]").violations
    callbacks: dict[str, Job] = {}
    try:
        callbacks = parse_callbacks(doc, str(kind), lambda cb: _step(cb, shared, options))
    except SpecError as exc:
        violations += exc.violations
    if violations:
        raise SpecError(violations)
    return Workflow(
        str(kind), steps, doc.get("id"), doc.get("name"), shared.get("meta", {}), callbacks
    )


def _shared_meta(doc: Mapping[str, Any]) -> dict[str, Any]:
    meta = doc.get("meta") if isinstance(doc.get("meta"), Mapping) else {}
    return {"id": doc.get("id"), "name": doc.get("name"), "meta": dict(meta or {})}


def _step(step: Any, shared: dict[str, Any], options: ParseOptions) -> Job:
    job = parse_job(step, options)
    workflow_info = {k: v for k, v in shared.items() if k != "meta" and v is not None}
    job.meta = {**shared["meta"], **job.meta, "workflow": workflow_info}
    return job


def canonical(
    doc: Mapping[str, Any], options: ParseOptions = DEFAULT_OPTIONS
) -> list[dict[str, Any]]:
    """One canonical requirements object per step."""
    return [step.canonical() for step in parse_workflow(doc, options).steps]
