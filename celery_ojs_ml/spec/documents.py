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
from celery_ojs_ml.spec.envelope import (
    DEFAULT_OPTIONS,
    Job,
    ParseOptions,
    parse_job,
    requirements_of,
)
from celery_ojs_ml.spec.flux import FluxJob, looks_like_jobspec, parse_jobspec
from celery_ojs_ml.spec.workflow import Workflow, is_workflow, parse_workflow

Document = Job | Workflow | FluxJob


def load_text(text: str, *, name: str = "<input>") -> Any:
    """Parse JSON, falling back to YAML (Flux jobspecs); raise SpecError on syntax errors.

    A YAML alias inside its own anchor makes a value contain itself, which no
    JSON document can: it is rejected here, before anything walks or prints it.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as json_error:
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError:
            raise SpecError(
                Violation(
                    name,
                    f"is neither valid JSON nor YAML ({json_error})",
                    "OJS core",
                    "check the file's syntax",
                )
            ) from None
    if _refers_to_itself(doc):
        problem = "refers to itself through a YAML alias (*name) inside its own anchor (&name)"
        fix = "write the value out in full: a job document is a tree, as in JSON"
        raise SpecError(Violation(name, problem, "OJS core", fix))
    return doc


def _refers_to_itself(doc: Any) -> bool:
    """Whether a container holds itself; each container is walked once, so aliases stay cheap."""
    done: set[int] = set()
    ancestors: set[int] = set()
    stack: list[tuple[Any, bool]] = [(doc, False)]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            ancestors.discard(id(node))
            done.add(id(node))
        elif isinstance(node, dict | list) and id(node) not in done:
            if id(node) in ancestors:
                return True
            ancestors.add(id(node))
            stack.append((node, True))
            stack.extend(
                (child, False) for child in (node.values() if isinstance(node, dict) else node)
            )
    return False


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
    if isinstance(parsed, FluxJob):  # the queue's policy applies as at submit (§10.1/§10.2)
        slot = requirements_of(parsed.slot_requirements(), parsed.queue, options)[0].flat()
        return [dict(slot) for _ in range(parsed.task_count)]
    return parsed.canonical()


def requirements_doc(doc: Any, options: ParseOptions = DEFAULT_OPTIONS) -> Job:
    """One job for matching: an envelope, bare `ext_ml_*` keys, or a Flux jobspec's slot."""
    if looks_like_jobspec(doc):
        flux = parse_jobspec(doc)
        return Job(
            type=None,
            requirements=requirements_of(flux.slot_requirements(), flux.queue, options)[0],
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
