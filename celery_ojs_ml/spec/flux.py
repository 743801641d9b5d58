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

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import yaml
from jsonschema import Draft7Validator
from jsonschema.exceptions import ValidationError

from celery_ojs_ml.errors import SpecError, Violation

__all__ = ["FluxJob", "FluxSlot", "looks_like_jobspec", "parse_jobspec"]

_RFC = "Flux RFC 25"
OVERVIEW = f"{_RFC} §Overview"
LANGUAGE = f"{_RFC} §Jobspec Language Definition"
RESOURCES = f"{_RFC} §Resources"
GRAPH = f"{_RFC} §V1-Specific Resource Graph Restrictions"
TASKS = f"{_RFC} §Tasks"
ATTRIBUTES = f"{_RFC} §Attributes"
SCHEMA = f"{_RFC} §Schema"

DOCUMENT = "<document>"
_TOP_KEYS = ("version", "resources", "tasks", "attributes")
CORE_EXAMPLE = '{"type": "core", "count": 2}'
SLOT_EXAMPLE = (
    '{"type": "slot", "count": 1, "label": "default", "with": [{"type": "core", "count": 2}]}'
)
TASK_EXAMPLE = '{"command": ["app"], "slot": "default", "count": {"per_slot": 1}}'
DURATION_FIX = 'give the run time in seconds, e.g. "duration": 3600 (0 means unlimited)'

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
        violations = _rule_violations(doc)
        violations += _unshadowed(_schema_violations(doc), violations)
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
    return _is_int(version) and version == 1 and isinstance(res, list) and "tasks" in doc


def _load(source: object) -> dict[str, Any]:
    loaded = _load_yaml(source) if isinstance(source, str) else source
    if not isinstance(loaded, Mapping):
        problem = f"is {_show(loaded)} but must be a mapping of the four V1 keys"
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


@cache
def _validator() -> Draft7Validator:
    text = resources.files("celery_ojs_ml.spec").joinpath("data/jobspec_v1.schema.json")
    return Draft7Validator(json.loads(text.read_text(encoding="utf-8")))


def _rule_violations(doc: dict[str, Any]) -> list[Violation]:
    return [
        *_check_version(doc),
        *_check_resources(doc.get("resources")),
        *_check_tasks(doc.get("tasks"), _slot_label(doc)),
        *_check_attributes(doc),
    ]


def _check_version(doc: Mapping[str, Any]) -> list[Violation]:
    if "version" not in doc or (_is_int(doc["version"]) and doc["version"] == 1):
        return []
    problem = f"{_is(doc, 'version')} but this parser reads jobspec version 1 only"
    return [Violation("version", problem, LANGUAGE, 'set "version": 1')]


def _check_resources(res: Any) -> list[Violation]:
    if not isinstance(res, list):
        return []
    out: list[Violation] = []
    if len(res) != 1:
        problem = f"has {len(res)} elements but V1 requires exactly one, a node or a slot"
        out.append(Violation("resources", problem, GRAPH, f"keep one, e.g. [{SLOT_EXAMPLE}]"))
    top = res[0] if res else None
    if not isinstance(top, Mapping):
        return out
    if top.get("type") in ("node", "slot"):
        check = _check_node if top["type"] == "node" else _check_slot
        return out + check("resources[0]", top)
    problem = f"{_is(top, 'type')} but V1 requires node or slot as the first and only resource"
    return [*out, Violation("resources[0].type", problem, GRAPH, f"e.g. {SLOT_EXAMPLE}")]


def _check_node(path: str, node: Mapping[str, Any]) -> list[Violation]:
    out = _check_count(path, node, "count", RESOURCES)
    children = node.get("with")
    if not isinstance(children, list):
        return out
    for i, child in enumerate(children):
        if isinstance(child, Mapping) and child.get("type") != "slot":
            problem = f"{_is(child, 'type')} but in V1 a node has out edges only to a slot"
            fix = f"put a slot between node and core (node>slot>core), e.g. {SLOT_EXAMPLE}"
            out.append(Violation(f"{path}.with[{i}].type", problem, GRAPH, fix))
    if len(children) != 1:
        problem = f"has {len(children)} vertices but a V1 node holds exactly one slot"
        out.append(Violation(f"{path}.with", problem, GRAPH, f"e.g. [{SLOT_EXAMPLE}]"))
    elif isinstance(children[0], Mapping) and children[0].get("type") == "slot":
        out += _check_slot(f"{path}.with[0]", children[0])
    return out


def _check_slot(path: str, slot: Mapping[str, Any]) -> list[Violation]:
    out = _check_count(path, slot, "count", RESOURCES)
    if "label" not in slot:
        problem = "is missing but a slot MUST carry a label (RFC 14) for tasks[0].slot to name"
        out.append(Violation(f"{path}.label", problem, RESOURCES, 'e.g. "label": "default"'))
    children = slot.get("with")
    if isinstance(children, list):
        out += _check_slot_children(f"{path}.with", children)
    return out


def _check_slot_children(path: str, children: list[Any]) -> list[Violation]:
    out: list[Violation] = []
    kinds: list[str] = []
    for i, child in enumerate(children):
        if not isinstance(child, Mapping):
            continue
        if child.get("type") in ("core", "gpu"):
            kinds.append(child["type"])
            out += _check_count(f"{path}[{i}]", child, "count", RESOURCES)
        else:
            problem = f"{_is(child, 'type')} but under a slot V1 allows only core and gpu"
            out.append(Violation(f"{path}[{i}].type", problem, GRAPH, f"e.g. {CORE_EXAMPLE}"))
    if "core" not in kinds:
        problem = "has no core vertex but the V1 resource graph MUST contain core"
        if "gpu" in kinds:
            problem = "has a gpu without a core but V1 allows a gpu only beside a core"
        fix = f"add a core vertex under the slot, e.g. {CORE_EXAMPLE}"
        out.append(Violation(path, problem, GRAPH, fix))
    for kind in ("core", "gpu"):
        if kinds.count(kind) > 1:
            problem = f"has {kinds.count(kind)} {kind} vertices but V1 allows one core, one gpu"
            fix = (
                f'merge them, summing counts, e.g. [{CORE_EXAMPLE}, {{"type": "gpu", "count": 1}}]'
            )
            out.append(Violation(path, problem, GRAPH, fix))
    return out


def _check_count(path: str, holder: Mapping[str, Any], key: str, section: str) -> list[Violation]:
    if key not in holder or (_is_int(holder[key]) and holder[key] >= 1):
        return []
    problem = f"{_is(holder, key)} but must be a single positive integer"
    return [Violation(f"{path}.{key}", problem, section, f'e.g. "{key}": 2')]


def _check_tasks(tasks: Any, label: str | None) -> list[Violation]:
    if not isinstance(tasks, list):
        return []
    if len(tasks) != 1:
        problem = f"has {len(tasks)} tasks but V1 MUST define exactly one task"
        return [Violation("tasks", problem, TASKS, f"e.g. [{TASK_EXAMPLE}]")]
    task = tasks[0]
    if not isinstance(task, Mapping):
        return []
    return [*_check_task_count(task), *_check_task_slot(task, label), *_check_command(task)]


def _check_task_count(task: Mapping[str, Any]) -> list[Violation]:
    count = task.get("count")
    if not isinstance(count, Mapping):
        return []
    keys = [key for key in ("per_slot", "total") if key in count]
    if len(keys) == 1:
        return _check_count("tasks[0].count", count, keys[0], TASKS)
    sets = "both per_slot and total" if keys else "neither per_slot nor total"
    problem = f"sets {sets} but must set exactly one"
    fix = 'e.g. "count": {"per_slot": 1} or "count": {"total": 5}'
    return [Violation("tasks[0].count", problem, TASKS, fix)]


def _check_task_slot(task: Mapping[str, Any], label: str | None) -> list[Violation]:
    slot = task.get("slot")
    if label is None or not isinstance(slot, str) or slot == label:
        return []
    problem = f"is {_show(slot)} but must name the slot label in resources, {_show(label)}"
    return [Violation("tasks[0].slot", problem, TASKS, f'e.g. "slot": {_show(label)}')]


def _check_command(task: Mapping[str, Any]) -> list[Violation]:
    if task.get("command") not in ("", []):
        return []
    problem = "is empty but must name the program to run"
    return [Violation("tasks[0].command", problem, TASKS, 'e.g. "command": ["app", "--verbose"]')]


def _check_attributes(doc: Mapping[str, Any]) -> list[Violation]:
    attrs = doc.get("attributes")
    if "attributes" not in doc or not isinstance(attrs, Mapping | None):
        return []
    if attrs is None or "system" not in attrs:
        problem = "is missing but V1 attributes MUST contain system, with a duration"
        fix = 'e.g. "attributes": {"system": {"duration": 3600}}'
        return [Violation("attributes.system", problem, ATTRIBUTES, fix)]
    system = attrs["system"]
    if not isinstance(system, Mapping):
        return []
    return [*_check_duration(system), *_check_queue(system)]


def _check_duration(system: Mapping[str, Any]) -> list[Violation]:
    path = "attributes.system.duration"
    if "duration" not in system:
        return [Violation(path, "is missing but jobspec V1 requires it", ATTRIBUTES, DURATION_FIX)]
    if _is_seconds(system["duration"]):
        return []
    problem = f"{_is(system, 'duration')} but must be a finite number of seconds >= 0"
    return [Violation(path, problem, ATTRIBUTES, DURATION_FIX)]


def _check_queue(system: Mapping[str, Any]) -> list[Violation]:
    queue = system.get("queue")
    if "queue" not in system or (isinstance(queue, str) and queue):
        return []
    problem = f"{_is(system, 'queue')} but must be a non-empty queue name"
    return [Violation("attributes.system.queue", problem, ATTRIBUTES, 'e.g. "queue": "gpu"')]


def _slot_label(doc: Mapping[str, Any]) -> str | None:
    vertex: Any = doc.get("resources")
    for _ in range(2):
        if not (isinstance(vertex, list) and len(vertex) == 1 and isinstance(vertex[0], Mapping)):
            return None
        if vertex[0].get("type") == "slot":
            label = vertex[0].get("label")
            return label if isinstance(label, str) else None
        vertex = vertex[0].get("with")
    return None


def _schema_violations(doc: dict[str, Any]) -> list[Violation]:
    return [v for error in _validator().iter_errors(doc) for v in _convert(error)]


def _document_order(violation: Violation) -> int:
    top = re.split(r"[.\[]", violation.path, maxsplit=1)[0]
    return _TOP_KEYS.index(top) if top in _TOP_KEYS else len(_TOP_KEYS)


def _unshadowed(schema: list[Violation], rules: list[Violation]) -> list[Violation]:
    spoken = {v.path for v in rules}
    return [v for v in dict.fromkeys(schema) if v.path not in spoken]


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
        problem = f"is {_show(error.instance)} but must be a resource vertex mapping"
        return [Violation(path, problem, SCHEMA, f"e.g. {_example(path)}")]
    type_path = _join(path, "type")
    problem = f"{_is(error.instance, 'type')} but is not a vertex type allowed here"
    return [Violation(type_path, problem, SCHEMA, f"e.g. {_example(type_path)}")]


def _is_type_mismatch(error: ValidationError) -> bool:
    where = list(error.relative_path)
    return where == ["type"] or (not where and error.validator == "type")


def _problem(error: ValidationError) -> str:
    value, limit, shown = error.validator_value, error.validator, _show(error.instance)
    if limit == "type":
        wanted = [value] if isinstance(value, str) else value
        return f"is {shown} but must be {' or '.join(_TYPE_WORDS.get(t, f'a {t}') for t in wanted)}"
    if limit == "enum":
        return f"is {shown} but must be one of {', '.join(_show(v) for v in value)}"
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


def _is(holder: Mapping[str, Any], key: str) -> str:
    return f"is {_show(holder[key])}" if key in holder else "is missing"


def _show(value: Any) -> str:
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_seconds(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:
        return False


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
    )
