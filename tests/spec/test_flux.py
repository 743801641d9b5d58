"""Flux RFC 25 jobspec V1: every example in the RFC parses, every checkable rule rejects.

The RFC's examples and its JSON Schema are read from the RFC text itself at test
time, so the suite cannot drift from the document it claims to implement.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft7Validator

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.flux import FluxJob, FluxSlot, looks_like_jobspec, parse_jobspec

REPO = Path(__file__).resolve().parents[2]
RFC_PATH = REPO.parent / "shared" / "spec" / "flux-rfc25-jobspec-v1.txt"
EXPECTED_EXAMPLES = [
    "example-jobspec",
    "use-case-1.1",
    "use-case-2.1",
    "use-case-2.2",
    "use-case-2.3",
    "use-case-2.4",
]
GRAPH = "Flux RFC 25 §V1-Specific Resource Graph Restrictions"


def _rfc_lines() -> list[str]:
    if not RFC_PATH.is_file():
        raise FileNotFoundError(f"Flux RFC 25 text is missing at {RFC_PATH}; these tests need it")
    return RFC_PATH.read_text(encoding="utf-8").splitlines()


def _yaml_line(line: str) -> bool:
    """Inside a jobspec block: indented, a list item, or one of the four top-level keys."""
    return line.startswith((" ", "-")) or bool(
        re.match(r"(version|resources|tasks|attributes):", line)
    )


def _rfc_examples() -> dict[str, str]:
    """Each YAML block of the RFC, keyed by the heading above it.

    In the text rendering a block starts at a line `version: 1` (after "Example
    Jobspec", or after "Jobspec YAML" in a use case) and runs while lines look
    like YAML; it ends at a blank line or at prose such as the next "Use Case" heading.
    """
    lines, blocks, heading, i = _rfc_lines(), {}, None, 0
    while i < len(lines):
        if re.fullmatch(r"Example Jobspec|Use Case \d+\.\d+", lines[i]):
            heading = lines[i].lower().replace(" ", "-")
        if lines[i] != "version: 1":
            i += 1
            continue
        start = i
        while i < len(lines) and _yaml_line(lines[i]):
            i += 1
        assert heading is not None and heading not in blocks, f"unexpected block at line {start}"
        blocks[heading] = "\n".join(lines[start:i]) + "\n"
    return blocks


def _rfc_schema() -> dict[str, Any]:
    """The JSON object under the RFC's "Schema" heading, from `{` to the closing `}`."""
    lines = _rfc_lines()
    start = lines.index("{", lines.index("Schema"))
    schema: dict[str, Any] = json.loads("\n".join(lines[start : lines.index("}", start) + 1]))
    return schema


RFC_EXAMPLES = _rfc_examples()
MAIN = RFC_EXAMPLES["example-jobspec"]


def _doc() -> dict[str, Any]:
    """The RFC's Example Jobspec as a fresh mapping, ready to be broken."""
    loaded: dict[str, Any] = yaml.safe_load(MAIN)
    return loaded


def _slot_doc(*children: dict[str, Any]) -> dict[str, Any]:
    doc = _doc()
    doc["resources"] = [{"type": "slot", "count": 1, "label": "default", "with": list(children)}]
    return doc


def _rejection(doc: Any) -> SpecError:
    with pytest.raises(SpecError) as caught:
        parse_jobspec(doc)
    return caught.value


def _sections(error: SpecError, path: str) -> list[str]:
    return [v.section for v in error.violations if v.path == path]


# --- the RFC's own examples and schema -------------------------------------------------


def test_the_rfc_text_holds_the_example_jobspec_and_five_use_case_blocks() -> None:
    assert list(RFC_EXAMPLES) == EXPECTED_EXAMPLES
    assert _rfc_lines().count("Jobspec YAML") == len(EXPECTED_EXAMPLES) - 1


@pytest.mark.parametrize("name", EXPECTED_EXAMPLES)
def test_every_jobspec_example_in_rfc_25_parses(name: str) -> None:
    """Flux RFC 25 §Example Jobspec and §Basic Use Cases: the use cases SHALL be supported."""
    assert isinstance(parse_jobspec(RFC_EXAMPLES[name]), FluxJob)


def test_the_packaged_schema_is_the_rfc_schema_verbatim_and_valid_draft_7() -> None:
    """Flux RFC 25 §Schema: a V1 jobspec SHALL adhere to this ruleset."""
    packaged = resources.files("celery_ojs_ml.spec").joinpath("data/jobspec_v1.schema.json")
    schema = json.loads(packaged.read_text(encoding="utf-8"))
    assert schema == _rfc_schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    Draft7Validator.check_schema(schema)


# --- mapping ---------------------------------------------------------------------------


def test_the_main_example_maps_to_four_spread_slots_of_two_cores() -> None:
    assert parse_jobspec(MAIN) == FluxJob(
        slot=FluxSlot(cores=2, gpus=0, label="default"),
        slot_count=4,
        task_count=4,
        nodes=4,
        spread=True,
        duration_s=3600.0,
        queue=None,
        command=["app"],
        attributes={
            "system": {
                "duration": 3600.0,
                "cwd": "/home/flux",
                "environment": {"HOME": "/home/flux"},
            }
        },
        cwd="/home/flux",
        environment={"HOME": "/home/flux"},
    )


@pytest.mark.parametrize(
    ("name", "slot", "slot_count", "task_count", "nodes"),
    [
        ("use-case-1.1", FluxSlot(1, 0, "default"), 4, 4, 4),
        ("use-case-2.1", FluxSlot(1, 0, "myslot"), 4, 5, 4),
        ("use-case-2.2", FluxSlot(2, 0, "default"), 10, 10, None),
        ("use-case-2.3", FluxSlot(2, 1, "default"), 10, 10, None),
        ("use-case-2.4", FluxSlot(1, 1, "default"), 16, 16, 4),
    ],
)
def test_each_use_case_maps_to_the_slots_and_tasks_its_prose_describes(
    name: str, slot: FluxSlot, slot_count: int, task_count: int, nodes: int | None
) -> None:
    job = parse_jobspec(RFC_EXAMPLES[name])
    assert (job.slot, job.slot_count, job.task_count) == (slot, slot_count, task_count)
    assert (job.nodes, job.spread) == (nodes, nodes is not None)


def test_a_cpu_slot_asks_for_its_cores_and_a_timeout_rounded_up() -> None:
    assert parse_jobspec(MAIN).slot_requirements() == {
        "ext_ml_cpu_cores": 2,
        "ext_ml_timeout_seconds": 3600,
        "ext_ml_accelerator": "cpu",
    }
    doc = _doc()
    doc["attributes"]["system"]["duration"] = 0.2
    assert parse_jobspec(doc).slot_requirements()["ext_ml_timeout_seconds"] == 1


def test_a_gpu_slot_asks_for_a_gpu_accelerator_and_its_gpu_count() -> None:
    assert parse_jobspec(RFC_EXAMPLES["use-case-2.3"]).slot_requirements() == {
        "ext_ml_cpu_cores": 2,
        "ext_ml_timeout_seconds": 3600,
        "ext_ml_accelerator": "gpu",
        "ext_ml_gpu_count": 1,
    }


def test_a_zero_duration_means_unlimited_and_sets_no_timeout() -> None:
    doc = _doc()
    doc["attributes"]["system"]["duration"] = 0
    assert "ext_ml_timeout_seconds" not in parse_jobspec(doc).slot_requirements()


def test_queue_and_user_attributes_are_carried_through_untouched() -> None:
    doc = _doc()
    doc["attributes"]["system"]["queue"] = "gpu-batch"
    doc["attributes"]["user"] = {"project": "demo", "tags": [1, {"x": None}]}
    job = parse_jobspec(doc)
    assert job.queue == "gpu-batch"
    assert job.attributes == doc["attributes"]


def test_a_string_command_becomes_a_one_element_command_list() -> None:
    doc = _doc()
    doc["tasks"][0]["command"] = "hostname"
    assert parse_jobspec(doc).command == ["hostname"]


def test_a_loaded_mapping_and_its_yaml_text_parse_to_the_same_job() -> None:
    assert parse_jobspec(_doc()) == parse_jobspec(MAIN)


def test_looks_like_jobspec_tells_a_jobspec_from_an_ojs_job() -> None:
    assert looks_like_jobspec(_doc())
    assert not looks_like_jobspec({"type": "train", "args": [], "ext_ml_gpu_count": 1})
    assert not looks_like_jobspec({**_doc(), "version": True})
    assert not looks_like_jobspec(["version", 1])


# --- exact user-facing text ------------------------------------------------------------


def test_a_slot_without_a_core_is_rejected_naming_the_path() -> None:
    """Flux RFC 25 §V1-Specific Resource Graph Restrictions: the graph MUST contain core."""
    doc = _doc()
    doc["resources"][0]["with"][0]["with"] = [{"type": "gpu", "count": 1}]
    assert str(_rejection(doc)) == (
        "resources[0].with[0].with has a gpu without a core but V1 allows a gpu only beside a"
        f' core ({GRAPH}); add a core vertex under the slot, e.g. {{"type": "core", "count": 2}}'
    )


def test_a_missing_duration_is_rejected_with_an_example() -> None:
    """Flux RFC 25 §Attributes: the duration attribute is required in jobspec V1."""
    doc = _doc()
    del doc["attributes"]["system"]["duration"]
    assert str(_rejection(doc)) == (
        "attributes.system.duration is missing but jobspec V1 requires it (Flux RFC 25"
        ' §Attributes); give the run time in seconds, e.g. "duration": 3600 (0 means unlimited)'
    )


def test_a_yaml_syntax_error_is_reported_at_the_document_with_its_position() -> None:
    """Flux RFC 25 §Overview: jobspec SHALL consist of a single YAML document."""
    assert str(_rejection("version: 1\nresources: [\n")) == (
        "<document> is not a single valid YAML document: expected the node content, but found"
        " '<stream end>' at line 3, column 1 (Flux RFC 25 §Overview); write one YAML mapping,"
        " e.g. `version: 1` then resources, tasks, attributes"
    )


def test_every_violation_is_reported_at_once_in_document_order() -> None:
    doc = _doc()
    doc["version"] = 2
    doc["tasks"].append(doc["tasks"][0])
    del doc["attributes"]["system"]["duration"]
    doc["resources"][0]["with"][0]["with"] = []
    assert _rejection(doc).paths == [
        "version",
        "resources[0].with[0].with",
        "tasks",
        "attributes.system.duration",
    ]


# --- Flux RFC 25 §Overview and §Jobspec Language Definition ----------------------------


def test_two_yaml_documents_in_one_text_are_rejected() -> None:
    """Flux RFC 25 §Overview: a jobspec SHALL consist of a single YAML document."""
    assert _rejection(MAIN + "---\n" + MAIN).paths == ["<document>"]


@pytest.mark.parametrize("source", [[], "- 1\n", "", 7], ids=["list", "yaml-list", "empty", "int"])
def test_a_document_that_is_not_a_dictionary_is_rejected(source: Any) -> None:
    """Flux RFC 25 §Jobspec Language Definition: a V1 document SHALL be a dictionary."""
    error = _rejection(source)
    assert _sections(error, "<document>") == ["Flux RFC 25 §Jobspec Language Definition"]


@pytest.mark.parametrize("key", ["resources", "tasks", "attributes", "version"])
def test_each_required_top_level_key_is_reported_when_missing(key: str) -> None:
    """Flux RFC 25 §Jobspec Language Definition: MUST contain resources, tasks, attributes,
    version."""
    doc = _doc()
    del doc[key]
    assert _rejection(doc).paths == [key]


@pytest.mark.parametrize("version", [2, "1", 1.0, True])
def test_a_version_other_than_the_integer_1_is_rejected(version: Any) -> None:
    """Flux RFC 25 §Jobspec Language Definition and §Schema: version is the integer 1."""
    doc = {**_doc(), "version": version}
    assert _rejection(doc).paths == ["version"]


# --- Flux RFC 25 §Resources and §V1-Specific Resource Graph Restrictions -----------------


@pytest.mark.parametrize(
    "children",
    [
        [{"type": "core", "count": 1}],
        [{"type": "core", "count": 1}, {"type": "gpu", "count": 2}],
        [{"type": "gpu", "count": 2}, {"type": "core", "count": 1}],
    ],
    ids=["core", "core-gpu", "gpu-core"],
)
@pytest.mark.parametrize("under_node", [False, True], ids=["slot", "node-slot"])
def test_each_of_the_four_enumerated_v1_graphs_is_accepted(
    children: list[dict[str, Any]], under_node: bool
) -> None:
    """Flux RFC 25 §V1-Specific Resource Graph Restrictions: slot>core, node>slot>core,
    slot>(core,gpu), node>slot>(core,gpu); the parentheses are a set, so order is free."""
    doc = _slot_doc(*children)
    if under_node:
        doc["resources"] = [{"type": "node", "count": 2, "with": doc["resources"]}]
    job = parse_jobspec(doc)
    gpus = 2 if len(children) == 2 else 0
    assert (job.slot.cores, job.slot.gpus, job.spread) == (1, gpus, under_node)


def test_a_resources_value_that_is_not_a_list_is_rejected() -> None:
    """Flux RFC 25 §Resources: the value of resources SHALL be a strict list."""
    doc = _doc()
    doc["resources"] = doc["resources"][0]
    assert _rejection(doc).paths == ["resources"]


@pytest.mark.parametrize("count", [0, 2])
def test_resources_with_other_than_exactly_one_element_is_rejected(count: int) -> None:
    """Flux RFC 25 §V1-Specific Resource Graph Restrictions: exactly one element."""
    doc = _doc()
    doc["resources"] = doc["resources"] * count
    assert _sections(_rejection(doc), "resources") == [GRAPH]


@pytest.mark.parametrize("kind", ["core", "gpu", "socket"])
def test_a_top_level_resource_other_than_node_or_slot_is_rejected(kind: str) -> None:
    """Flux RFC 25 §V1-Specific Resource Graph Restrictions: MUST be either node or slot."""
    doc = _doc()
    doc["resources"] = [{"type": kind, "count": 1}]
    assert _sections(_rejection(doc), "resources[0].type") == [GRAPH]


def test_a_node_holding_a_core_directly_is_rejected() -> None:
    """Flux RFC 25 §V1-Specific Resource Graph Restrictions: a node has out edges only to a slot."""
    doc = _doc()
    doc["resources"][0]["with"] = [{"type": "core", "count": 2}]
    assert _sections(_rejection(doc), "resources[0].with[0].type") == [GRAPH]


def test_a_node_holding_two_slots_is_rejected() -> None:
    """Flux RFC 25 §V1-Specific Resource Graph Restrictions and §Schema: one slot per node."""
    doc = _doc()
    doc["resources"][0]["with"] *= 2
    assert _sections(_rejection(doc), "resources[0].with") == [GRAPH]


@pytest.mark.parametrize(
    "children",
    [[], [{"type": "gpu", "count": 1}], [{"type": "gpu", "count": 1}, {"type": "gpu", "count": 1}]],
    ids=["empty", "gpu-alone", "two-gpus"],
)
def test_a_slot_without_a_core_is_rejected(children: list[dict[str, Any]]) -> None:
    """Flux RFC 25 §V1-Specific Resource Graph Restrictions: the graph MUST contain core,
    and a gpu may appear only beside a core."""
    assert GRAPH in _sections(_rejection(_slot_doc(*children)), "resources[0].with")


def test_two_cores_under_one_slot_are_rejected() -> None:
    """Flux RFC 25 §V1-Specific Resource Graph Restrictions: only slot>core or slot>(core,gpu)."""
    doc = _slot_doc({"type": "core", "count": 1}, {"type": "core", "count": 1})
    assert _sections(_rejection(doc), "resources[0].with") == [GRAPH]


@pytest.mark.parametrize("kind", ["slot", "node", "memory"])
def test_a_vertex_under_a_slot_other_than_core_or_gpu_is_rejected(kind: str) -> None:
    """Flux RFC 25 §Resources: in V1 only node, slot, core and gpu are valid; a slot holds
    only core and gpu (§V1-Specific Resource Graph Restrictions)."""
    doc = _slot_doc({"type": "core", "count": 1}, {"type": kind, "count": 1})
    assert _sections(_rejection(doc), "resources[0].with[1].type") == [GRAPH]


def test_a_core_with_out_edges_is_rejected() -> None:
    """Flux RFC 25 §Schema: a core or gpu vertex cannot have child vertices."""
    doc = _slot_doc({"type": "core", "count": 1, "with": [{"type": "gpu", "count": 1}]})
    assert _rejection(doc).paths == ["resources[0].with[0].with"]


def test_a_slot_without_a_label_is_rejected() -> None:
    """Flux RFC 25 §Resources (label as in RFC 14) and §Schema: a slot carries a label."""
    doc = _doc()
    del doc["resources"][0]["with"][0]["label"]
    assert _sections(_rejection(doc), "resources[0].with[0].label") == ["Flux RFC 25 §Resources"]


def test_an_unknown_key_on_a_vertex_is_rejected_listing_the_allowed_keys() -> None:
    """Flux RFC 25 §Resources: a vertex SHALL contain only type, count, unit, with, label."""
    doc = _doc()
    doc["resources"][0]["with"][0]["with"][0]["size"] = 3
    (violation,) = _rejection(doc).violations
    assert violation.path == "resources[0].with[0].with[0].size"
    assert violation.fix == "remove it; allowed keys here are type, count, unit"


@pytest.mark.parametrize("count", [0, -1, 2.0, 2.5, "2", True, {"min": 1, "max": 4}])
@pytest.mark.parametrize(
    "where",
    [("resources", 0), ("resources", 0, "with", 0), ("resources", 0, "with", 0, "with", 0)],
    ids=["node", "slot", "core"],
)
def test_a_count_that_is_not_a_single_positive_integer_is_rejected(
    count: Any, where: tuple[str | int, ...]
) -> None:
    """Flux RFC 25 §Resources: count SHALL be a single integer value (a fixed count); §Schema
    sets its minimum to 1."""
    doc = _doc()
    vertex: Any = doc
    for step in where:
        vertex = vertex[step]
    vertex["count"] = count
    path = "resources[0]" + ".with[0]" * ((len(where) - 2) // 2) + ".count"
    assert _sections(_rejection(doc), path) == ["Flux RFC 25 §Resources"]


# --- Flux RFC 25 §Tasks ----------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 2])
def test_tasks_with_other_than_exactly_one_task_is_rejected(count: int) -> None:
    """Flux RFC 25 §Tasks: the tasks list MUST define exactly one task."""
    doc = _doc()
    doc["tasks"] = doc["tasks"] * count
    assert _sections(_rejection(doc), "tasks") == ["Flux RFC 25 §Tasks"]


@pytest.mark.parametrize("key", ["command", "slot", "count"])
def test_a_task_missing_a_required_key_is_rejected(key: str) -> None:
    """Flux RFC 25 §Tasks: a task descriptor SHALL contain command, slot and count."""
    doc = _doc()
    del doc["tasks"][0][key]
    assert _rejection(doc).paths == [f"tasks[0].{key}"]


@pytest.mark.parametrize("count", [{}, {"per_slot": 1, "total": 4}])
def test_a_task_count_must_set_exactly_one_of_per_slot_or_total(count: dict[str, int]) -> None:
    """Flux RFC 25 §Tasks (count as in RFC 14): count is per_slot or total."""
    doc = _doc()
    doc["tasks"][0]["count"] = count
    assert _sections(_rejection(doc), "tasks[0].count") == ["Flux RFC 25 §Tasks"]


@pytest.mark.parametrize("key", ["per_slot", "total"])
def test_a_task_count_that_is_not_a_positive_integer_is_rejected(key: str) -> None:
    """Flux RFC 25 §Tasks and §Schema: per_slot and total are integers >= 1."""
    doc = _doc()
    doc["tasks"][0]["count"] = {key: 0}
    assert _rejection(doc).paths == [f"tasks[0].count.{key}"]


def test_a_task_naming_a_slot_label_that_does_not_exist_is_rejected() -> None:
    """Flux RFC 25 §Tasks (slot as in RFC 14): the task's slot names the slot's label."""
    doc = _doc()
    doc["tasks"][0]["slot"] = "other"
    assert str(_rejection(doc)).startswith(
        'tasks[0].slot is "other" but must name the slot label in resources, "default"'
    )


@pytest.mark.parametrize("command", [[], "", [1], {"app": 1}])
def test_a_command_that_is_empty_or_not_strings_is_rejected(command: Any) -> None:
    """Flux RFC 25 §Tasks and §Schema: command is a string or a non-empty list of strings."""
    doc = _doc()
    doc["tasks"][0]["command"] = command
    assert _rejection(doc).paths[0].startswith("tasks[0].command")


# --- Flux RFC 25 §Attributes -----------------------------------------------------------


@pytest.mark.parametrize("attributes", [None, {}, {"user": {"a": 1}}])
def test_attributes_without_system_are_rejected(attributes: Any) -> None:
    """Flux RFC 25 §Attributes: the attributes dictionary MUST contain the system key."""
    doc = {**_doc(), "attributes": attributes}
    assert _sections(_rejection(doc), "attributes.system") == ["Flux RFC 25 §Attributes"]


def test_an_unknown_attributes_key_is_rejected() -> None:
    """Flux RFC 25 §Attributes and §Schema: attributes holds only system and user."""
    doc = _doc()
    doc["attributes"]["extra"] = {}
    assert _rejection(doc).paths == ["attributes.extra"]


@pytest.mark.parametrize("duration", [-1, "1h", None, True, float("inf"), float("nan"), 10**400])
def test_a_duration_that_is_not_a_finite_number_of_seconds_is_rejected(duration: Any) -> None:
    """Flux RFC 25 §Attributes and §Schema: duration is a number >= 0."""
    doc = _doc()
    doc["attributes"]["system"]["duration"] = duration
    assert _sections(_rejection(doc), "attributes.system.duration") == ["Flux RFC 25 §Attributes"]


@pytest.mark.parametrize("queue", ["", 3, None])
def test_a_queue_that_is_not_a_non_empty_name_is_rejected(queue: Any) -> None:
    """Flux RFC 25 §Attributes: queue is a system attribute naming a queue (RFC 14)."""
    doc = _doc()
    doc["attributes"]["system"]["queue"] = queue
    assert _rejection(doc).paths == ["attributes.system.queue"]


# --- robustness ------------------------------------------------------------------------

_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_KEYS = st.sampled_from(["version", "resources", "tasks", "attributes", "type", "count", "with"])
_TREES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(_KEYS | st.text(max_size=6) | st.integers(), inner, max_size=5)
    ),
    max_leaves=25,
)


def _only_spec_errors(source: Any) -> None:
    try:
        parse_jobspec(source)
    except SpecError as error:
        assert error.violations and all(str(v) for v in error.violations)


@settings(max_examples=300, deadline=None)
@given(_TREES)
def test_arbitrary_nested_data_raises_nothing_but_spec_error(tree: Any) -> None:
    _only_spec_errors(tree)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    children = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else []
    )
    return [prefix, *(p for key, child in children for p in _paths(child, (*prefix, key)))]


@st.composite
def _mutated_examples(draw: Callable[..., Any]) -> Any:
    doc = copy.deepcopy(yaml.safe_load(RFC_EXAMPLES[draw(st.sampled_from(EXPECTED_EXAMPLES))]))
    path = draw(st.sampled_from(_paths(doc)[1:]))
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = draw(_TREES)
    return doc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated_examples())
def test_an_rfc_example_with_any_subtree_replaced_raises_nothing_but_spec_error(doc: Any) -> None:
    _only_spec_errors(doc)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_arbitrary_text_raises_nothing_but_spec_error(text: str) -> None:
    _only_spec_errors(text)
