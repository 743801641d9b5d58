"""Recognise a document (job envelope, workflow or Flux jobspec) and validate it.

Key decision: one entry point for every input form, chosen by shape, so the
CLI, `ml.submit()` and the demo accept the same documents and give the same
canonical output: a flat `ext_ml_*` object for a job, one object per step for
a workflow, and one per task for a Flux jobspec.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.spec.envelope import DEFAULT_OPTIONS, Job, ParseOptions, parse_job
from celery_ojs_ml.spec.flux import FluxJob, looks_like_jobspec, parse_jobspec
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.workflow import Workflow, is_workflow, parse_workflow

Document = Job | Workflow | FluxJob


def load_text(text: str, *, name: str = "<input>") -> Any:
    """Parse JSON, falling back to YAML (Flux jobspecs); raise SpecError on syntax errors."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as json_error:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            raise SpecError(
                Violation(
                    name,
                    f"is neither valid JSON nor YAML ({json_error})",
                    "OJS core",
                    "check the file's syntax",
                )
            ) from None


def parse_document(doc: Any, options: ParseOptions = DEFAULT_OPTIONS) -> Document:
    """A validated job, workflow or Flux jobspec, by the document's shape."""
    if is_workflow(doc):
        return parse_workflow(doc, options)
    if looks_like_jobspec(doc):
        return parse_jobspec(doc)
    return parse_job(doc, options)


def canonical(parsed: Document, options: ParseOptions = DEFAULT_OPTIONS) -> Any:
    """Canonical requirements: one object, or a list per workflow step / Flux task."""
    if isinstance(parsed, Workflow):
        return [step.canonical() for step in parsed.steps]
    if isinstance(parsed, FluxJob):
        slot = normalize(parsed.slot_requirements(), options.bounds).flat()
        return [dict(slot) for _ in range(parsed.task_count)]
    return parsed.canonical()


def requirements_doc(doc: Any, options: ParseOptions = DEFAULT_OPTIONS) -> Job:
    """One job for matching: an envelope, bare `ext_ml_*` keys, or a Flux jobspec's slot."""
    if looks_like_jobspec(doc):
        flux = parse_jobspec(doc)
        return Job(
            type=None,
            requirements=normalize(flux.slot_requirements(), options.bounds).requirements,
            queue=flux.queue,
        )
    if is_workflow(doc):
        raise SpecError(
            Violation(
                "workflow_type",
                "is a workflow; match takes one job",
                "OJS ML §12",
                "pass one step of the workflow as its own file",
            )
        )
    relaxed = ParseOptions(options.bounds, options.policies, require_type=False)
    return parse_job(doc, relaxed)
