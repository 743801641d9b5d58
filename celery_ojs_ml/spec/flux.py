"""Flux RFC 25 jobspec V1: validate a jobspec and map it to per-slot OJS ML requirements.

Responsibility: turn one jobspec V1 document (YAML text or a loaded mapping)
into a `FluxJob`, or raise a `SpecError` that lists every violation at once.

Key decision: two passes, one report. The RFC's own JSON Schema, packaged
verbatim, is the baseline. The V1 rules the schema cannot say (a core under
every slot, exactly one task, a required duration, the task naming the slot
label, ...) are hand-written checks with teaching messages. Where a hand-written
rule speaks about a path, the schema's generic message for that same path is
dropped, so each problem is reported once, in the clearest words.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.spec.flux_env import environment_of
from celery_ojs_ml.spec.flux_rules import is_int, rule_violations
from celery_ojs_ml.spec.flux_schema import schema_violations
from celery_ojs_ml.spec.flux_wording import DOCUMENT, LANGUAGE, OVERVIEW, show

__all__ = ["FluxJob", "FluxSlot", "looks_like_jobspec", "parse_jobspec"]


_TOP_KEYS = ("version", "resources", "tasks", "attributes")


@dataclass(frozen=True)
class FluxSlot:
    """Requirements of one task slot (Flux RFC 25 §Resources, the `slot` vertex)."""

    cores: int
    """Count of the `core` vertex under the slot."""
    gpus: int
    """Count of the `gpu` vertex under the slot; 0 when the slot has none."""
    label: str
    """The slot's `label`, which `tasks[0].slot` names."""


@dataclass(frozen=True)
class FluxJob:
    """A validated jobspec V1, in the terms the Celery layer schedules by."""

    slot: FluxSlot
    slot_count: int
    """Total slots: the product of the counts above and at the slot (nodes x slots per node)."""
    task_count: int
    """Celery tasks to run: `per_slot * slot_count`, or `total` (Flux RFC 25 §Tasks)."""
    nodes: int | None
    """Node count for a node>slot graph; None for a bare slot."""
    spread: bool
    """True for node>slot: the slots must land on distinct workers (one node per worker)."""
    duration_s: float
    """`attributes.system.duration` in seconds; 0 means unlimited. Becomes the time limit."""
    queue: str | None
    """`attributes.system.queue`, the logical queue, or None."""
    command: list[str]
    """`tasks[0].command`; a string command becomes a one-element list."""
    attributes: dict[str, Any]
    """The `attributes` mapping as given, `user` included and untouched."""
    cwd: str | None = None
    """`attributes.system.cwd`: the task's working directory on the worker (`spec.flux_env`)."""
    environment: dict[str, str] = field(default_factory=dict)
    """`attributes.system.environment`, values as text; set for the task's run only."""

    def slot_requirements(self) -> dict[str, Any]:
        """Flat OJS ML v0.3 requirement keys for one slot."""
        req: dict[str, Any] = {"ext_ml_cpu_cores": self.slot.cores}
        if self.duration_s > 0:
            req["ext_ml_timeout_seconds"] = math.ceil(self.duration_s)
        if self.slot.gpus > 0:
            req["ext_ml_accelerator"] = "gpu"
            req["ext_ml_gpu_count"] = self.slot.gpus
        else:
            req["ext_ml_accelerator"] = "cpu"
        return req


def parse_jobspec(source: str | Mapping[str, Any]) -> FluxJob:
    """Parse YAML text or an already-loaded mapping. Raises SpecError listing every violation."""
    try:
        doc = _load(source)
        violations = rule_violations(doc)
        violations += _unshadowed(schema_violations(doc), violations)
    except RecursionError:
        problem = "nests too deeply or refers to itself"
        fix = "write plain nested mappings and lists, as in the RFC 25 Example Jobspec"
        raise SpecError(Violation(DOCUMENT, problem, OVERVIEW, fix)) from None
    if violations:
        raise SpecError(sorted(violations, key=_document_order))
    return _to_job(doc)


def looks_like_jobspec(doc: Any) -> bool:
    """Whether `doc` is shaped like a jobspec: version 1, a resources list and tasks."""
    if not isinstance(doc, Mapping):
        return False
    version, res = doc.get("version"), doc.get("resources")
    return is_int(version) and version == 1 and isinstance(res, list) and "tasks" in doc


def _load(source: object) -> dict[str, Any]:
    loaded = _load_yaml(source) if isinstance(source, str) else source
    if not isinstance(loaded, Mapping):
        problem = f"is {show(loaded)} but must be a mapping of the four V1 keys"
        fix = 'e.g. {"version": 1, "resources": [...], "tasks": [...], "attributes": {...}}'
        raise SpecError(Violation(DOCUMENT, problem, LANGUAGE, fix))
    plain: dict[str, Any] = _plain(loaded)
    return plain


def _load_yaml(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:
        problem = f"is not a single valid YAML document: {_yaml_reason(exc)}"
        fix = "write one YAML mapping, e.g. `version: 1` then resources, tasks, attributes"
        raise SpecError(Violation(DOCUMENT, problem, OVERVIEW, fix)) from exc


def _yaml_reason(exc: Exception) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _plain(value: Any) -> Any:
    """Copy into dicts and lists, the only containers JSON Schema recognises."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def _document_order(violation: Violation) -> int:
    top = re.split(r"[.\[]", violation.path, maxsplit=1)[0]
    return _TOP_KEYS.index(top) if top in _TOP_KEYS else len(_TOP_KEYS)


def _unshadowed(schema: list[Violation], rules: list[Violation]) -> list[Violation]:
    spoken = {v.path for v in rules}
    return [v for v in dict.fromkeys(schema) if v.path not in spoken]


def _to_job(doc: dict[str, Any]) -> FluxJob:
    top = doc["resources"][0]
    nodes: int | None = top["count"] if top["type"] == "node" else None
    slot = top["with"][0] if nodes is not None else top
    counts = {child["type"]: child["count"] for child in slot["with"]}
    slot_count = slot["count"] * (nodes or 1)
    task = doc["tasks"][0]
    per_slot = task["count"].get("per_slot")
    system = doc["attributes"]["system"]
    command = task["command"]
    return FluxJob(
        slot=FluxSlot(cores=counts["core"], gpus=counts.get("gpu", 0), label=slot["label"]),
        slot_count=slot_count,
        task_count=per_slot * slot_count if per_slot is not None else task["count"]["total"],
        nodes=nodes,
        spread=nodes is not None,
        duration_s=float(system["duration"]),
        queue=system.get("queue"),
        command=[command] if isinstance(command, str) else list(command),
        attributes=doc["attributes"],
        cwd=system.get("cwd"),
        environment=environment_of(system.get("environment") or {}),
    )
