"""The jobspec V1 rules that the RFC 25 JSON Schema cannot say, as hand-written checks.

Each check speaks about one path with a teaching message: a core under every
slot, exactly one task, a required duration, the task naming the slot label.
`parse_jobspec` (`spec/flux.py`) drops the schema's own message for any path
a check here speaks about.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

from celery_ojs_ml.errors import Violation
from celery_ojs_ml.spec.flux_env import cwd_violations, environment_violations
from celery_ojs_ml.spec.flux_wording import (
    ATTRIBUTES,
    CORE_EXAMPLE,
    DURATION_FIX,
    GRAPH,
    LANGUAGE,
    RESOURCES,
    SLOT_EXAMPLE,
    TASK_EXAMPLE,
    TASKS,
    describe,
    show,
)


def rule_violations(doc: dict[str, Any]) -> list[Violation]:
    """Every V1 rule the schema cannot say that `doc` breaks."""
    return [
        *_check_version(doc),
        *_check_resources(doc.get("resources")),
        *_check_tasks(doc.get("tasks"), _slot_label(doc)),
        *_check_attributes(doc),
    ]


def _check_version(doc: Mapping[str, Any]) -> list[Violation]:
    if "version" not in doc or (is_int(doc["version"]) and doc["version"] == 1):
        return []
    problem = f"{describe(doc, 'version')} but this parser reads jobspec version 1 only"
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
    problem = f"{describe(top, 'type')} but V1 requires node or slot as the first and only resource"
    return [*out, Violation("resources[0].type", problem, GRAPH, f"e.g. {SLOT_EXAMPLE}")]


def _check_node(path: str, node: Mapping[str, Any]) -> list[Violation]:
    out = _check_count(path, node, "count", RESOURCES)
    children = node.get("with")
    if not isinstance(children, list):
        return out
    for i, child in enumerate(children):
        if isinstance(child, Mapping) and child.get("type") != "slot":
            problem = f"{describe(child, 'type')} but in V1 a node has out edges only to a slot"
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
            problem = f"{describe(child, 'type')} but under a slot V1 allows only core and gpu"
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
    if key not in holder or (is_int(holder[key]) and holder[key] >= 1):
        return []
    problem = f"{describe(holder, key)} but must be a single positive integer"
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
    problem = f"is {show(slot)} but must name the slot label in resources, {show(label)}"
    return [Violation("tasks[0].slot", problem, TASKS, f'e.g. "slot": {show(label)}')]


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
    return [
        *_check_duration(system),
        *_check_queue(system),
        *cwd_violations(system),  # spec.flux_env: applied by the pool child
        *environment_violations(system),
    ]


def _check_duration(system: Mapping[str, Any]) -> list[Violation]:
    path = "attributes.system.duration"
    if "duration" not in system:
        return [Violation(path, "is missing but jobspec V1 requires it", ATTRIBUTES, DURATION_FIX)]
    if _is_seconds(system["duration"]):
        return []
    problem = f"{describe(system, 'duration')} but must be a finite number of seconds >= 0"
    return [Violation(path, problem, ATTRIBUTES, DURATION_FIX)]


def _check_queue(system: Mapping[str, Any]) -> list[Violation]:
    queue = system.get("queue")
    if "queue" not in system or (isinstance(queue, str) and queue):
        return []
    problem = f"{describe(system, 'queue')} but must be a non-empty queue name"
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


def is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_seconds(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:
        return False
