"""Hypothesis strategies shared by the fuzz tests: junk values, attributes and documents.

Key decision: valid-ish beats random. Every attribute value is drawn half from
the values the spec examples use (so most documents get past the first check
and reach the deep rules) and half from junk (wrong types, huge and negative
numbers, NaN, unicode, long strings, nested containers), and whole documents
are the examples with a few keys replaced, deleted or added.
"""

from __future__ import annotations

import copy
import json
import re
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from celery_ojs_ml.spec.mlx import KNOWN_ATTRIBUTES
from celery_ojs_ml.spec.resources import KNOWN_KEYS
from tests.helpers import EXAMPLES

JOBS_DIR = EXAMPLES / "jobs"
JSON_EXAMPLES: dict[str, Any] = {
    p.name: json.loads(p.read_text(encoding="utf-8")) for p in sorted(JOBS_DIR.glob("*.json"))
}
FLUX_TEXT = (JOBS_DIR / "flux-rfc25-example.yaml").read_text(encoding="utf-8")
FLUX_EXAMPLE: dict[str, Any] = yaml.safe_load(FLUX_TEXT)
WORKFLOWS = [d for d in JSON_EXAMPLES.values() if "workflow_type" in d]
ENVELOPES = [d for d in JSON_EXAMPLES.values() if "workflow_type" not in d]

_CURATED: dict[str, list[Any]] = {
    "ext_ml_affinity": [
        {"required": [{"key": "region", "operator": "In", "values": ["us-east-1"]}]},
        {"preferred": [{"key": "zone", "operator": "Exists", "weight": 50}]},
        {"required": [{"key": "gpu_memory_gb", "operator": "Gt", "values": ["40"]}]},
    ],
    "ext_ml_anti_affinity": [
        {"required": [{"key": "model_id", "operator": "In", "values": ["llama"]}]},
    ],
    "ext_ml_escalation_after_s": [3600, 1],
    "ext_ml_escalation_target_class": ["reserved", "on-demand", "spot"],
    "ext_ml_priority_escalation": [True, False],
    "ext_ml_model_checksum": ["sha256:e3b0c44298fc", "md5:abc"],
    "ext_ml_model_registry": ["huggingface", "mlflow", "s3"],
    "ext_ml_model_registry_uri": [
        "hf://meta-llama/Llama-3.1-70B-Instruct@main",
        "s3://models/../../etc/passwd",
        "http://169.254.169.254/latest/meta-data/",
    ],
    "ext_ml_reservation_id": ["res-123"],
    "ext_ml_reservation_timeout_s": [600],
    "ext_mlx_artifact_checkpoint_uri": ["s3://ckpt/run-1/", "ftp://x/y"],
    "ext_mlx_artifact_dataset_uri": ["gs://data/train.parquet"],
    "ext_mlx_artifact_output_uri": ["file:///out/", "s3://k?token=abc"],
    "ext_mlx_model_input_schema": [{"type": "object"}, {"type": "nonsense"}],
    "ext_mlx_model_output_schema": [{"type": "array", "items": {"type": "number"}}],
    "ext_mlx_scheduling_data_locality": ["s3://bucket/data/"],
    "ext_mlx_scheduling_gpu_affinity": ["spread", "pack", "dedicated"],
    "ext_mlx_scheduling_preemption_policy": ["never", "save_and_retry", "immediate"],
    "ext_mlx_scheduling_spot_preference": ["spot_preferred", "on_demand_only", "any"],
}


def _example_values() -> dict[str, list[Any]]:
    """Every value each ext_ml_*/ext_mlx_* key takes in examples/jobs, plus curated ones."""
    found: dict[str, list[Any]] = defaultdict(list)

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                if key.startswith("ext_ml") and value not in found[key]:
                    found[key].append(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(list(JSON_EXAMPLES.values()))
    for key, values in _CURATED.items():
        found[key] += values
    return dict(found)


EXAMPLE_VALUES = _example_values()
ATTRIBUTE_KEYS = sorted(KNOWN_KEYS | KNOWN_ATTRIBUTES | set(EXAMPLE_VALUES))

EDGE_NUMBERS: list[Any] = [
    0, -1, 1, 2**31, 2**63, 10**30, -(10**30), 0.5, -0.0, 1e-320, 1e308,
    float("inf"), float("-inf"), float("nan"),
]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.sampled_from(EDGE_NUMBERS)
    | st.text(max_size=24)
    | st.text(min_size=200, max_size=700)
    | st.sampled_from(["", " ", "gpu", "nvidia-a100", "NVIDIA-A100", "1.5", "s3://b/", "ü→漢"])
)
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=10,
)
"""Any JSON-like value, NaN and infinities included."""


def mostly(
    good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any] = junk
) -> st.SearchStrategy[Any]:
    """`good` three times in four, else `bad`: enough valid parts to reach the deep rules."""
    return st.one_of(good, good, good, bad)


_FLUX_COUNTS = ("count", "per_slot", "total")
_small_junk = junk.filter(lambda v: not (isinstance(v, int) and v > 4))


def value_for(key: str) -> st.SearchStrategy[Any]:
    """A value for one attribute: mostly a value the examples use for it, else junk.

    Flux counts stay small: their product is the number of tasks a jobspec makes.
    """
    if key in _FLUX_COUNTS:
        return mostly(st.integers(-1, 4), _small_junk)
    seen = EXAMPLE_VALUES.get(key)
    if not seen:
        return junk
    return mostly(st.sampled_from(seen).map(copy.deepcopy))


attribute_keys = (
    st.sampled_from(ATTRIBUTE_KEYS)
    | st.text(max_size=12).map(lambda s: "ext_ml_" + s)
    | st.text(max_size=12).map(lambda s: "ext_mlx_" + s)
    | st.sampled_from(["ext_ml", "ext_mlx", "ext_mlfoo", "ext_ml_GPU_COUNT"])
)
attributes = st.lists(
    attribute_keys.flatmap(lambda k: st.tuples(st.just(k), value_for(k))), max_size=6
).map(dict)
"""A dict of ext_ml_*/ext_mlx_* attributes, each valid-ish or junk."""


@st.composite
def corrupted(draw: st.DrawFn, docs: st.SearchStrategy[Any], most: int = 3) -> Any:
    """A document from `docs`, deep-copied, with up to `most` keys replaced, deleted or added."""
    doc = copy.deepcopy(draw(docs))
    for _ in range(draw(st.integers(0, most))):
        _mutate_once(draw, doc)
    return doc


def mutated(docs: list[Any]) -> st.SearchStrategy[Any]:
    """One of `docs` with up to three keys replaced, deleted or added."""
    return corrupted(st.sampled_from(docs))


def _mutate_once(draw: st.DrawFn, node: Any) -> None:
    while isinstance(node, dict | list) and node:
        keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
        key = draw(st.sampled_from(keys))
        child = node[key]
        if isinstance(child, dict | list) and child and draw(st.booleans()):
            node = child
            continue
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            node[key] = draw(value_for(key) if isinstance(key, str) else junk)
        elif action == "delete":
            del node[key]
        elif isinstance(node, dict):
            new_key = draw(attribute_keys | st.sampled_from(["type", "id", "queue", "meta"]))
            node[new_key] = draw(value_for(new_key))
        else:
            node.append(draw(junk))
        return


valid_attributes = st.lists(
    st.sampled_from(sorted(EXAMPLE_VALUES)).flatmap(
        lambda k: st.tuples(st.just(k), st.sampled_from(EXAMPLE_VALUES[k]).map(copy.deepcopy))
    ),
    max_size=4,
).map(dict)
"""A dict of attributes with values the examples use: often valid, sometimes in conflict."""

uuids = st.uuids().map(str)
legacy_meta = st.fixed_dictionaries(
    {},
    optional={
        "resources": st.fixed_dictionaries(
            {},
            optional={
                "gpu": st.fixed_dictionaries(
                    {},
                    optional={
                        "count": st.integers(0, 9),
                        "type": st.sampled_from(EXAMPLE_VALUES["ext_ml_gpu_type"]),
                        "memory_gb": st.integers(1, 200),
                    },
                ),
                "cpu": st.fixed_dictionaries({"cores": st.integers(1, 64)}),
                "memory_gb": st.integers(0, 999),
            },
        ),
        "affinity": st.sampled_from(EXAMPLE_VALUES["ext_ml_affinity"]),
        "checkpoint": st.fixed_dictionaries(
            {"enabled": st.booleans()},
            optional={
                "interval_s": st.integers(1, 3600),
                "storage_uri": st.sampled_from(["s3://ckpt/run/", "file:///tmp/ckpt/"]),
                "max_checkpoints": st.integers(1, 5),
            },
        ),
        "preemption": st.fixed_dictionaries(
            {"preemptible": st.booleans()}, optional={"grace_period_s": st.integers(0, 60)}
        ),
        "note": st.text(max_size=10),
    },
)
"""An OJS ML v0.1 `meta` block (§2.2), valid-ish."""
valid_envelopes = st.builds(
    lambda core, attrs: {**core, **attrs},
    st.fixed_dictionaries(
        {"type": st.sampled_from(["ml.train", "ml.other"])},
        optional={
            "id": uuids,
            "queue": st.sampled_from(["gpu", "train"]),
            "args": st.lists(junk, max_size=3),
            "kwargs": st.dictionaries(st.text(max_size=8), junk, max_size=3),
            "meta": legacy_meta,
        },
    ),
    valid_attributes,
)
envelopes = corrupted(valid_envelopes)
"""Envelopes in either form, valid-ish, then with up to three keys corrupted."""
workflows = corrupted(
    st.sampled_from([("chain", "steps"), ("group", "jobs"), ("batch", "jobs")]).flatmap(
        lambda kind: st.fixed_dictionaries(
            {
                "workflow_type": st.just(kind[0]),
                kind[1]: st.lists(valid_envelopes, min_size=1, max_size=4),
            },
            optional={"id": uuids, "name": st.text(max_size=10), "meta": junk},
        )
    )
)
"""Chains, groups and batches of valid-ish steps, then corrupted."""

_core = st.fixed_dictionaries({"type": st.just("core"), "count": st.integers(1, 3)})
_gpu = st.fixed_dictionaries({"type": st.just("gpu"), "count": st.integers(1, 2)})
_slot = st.fixed_dictionaries(
    {
        "type": st.just("slot"),
        "count": st.integers(1, 2),
        "label": st.just("default"),
        "with": st.tuples(_core, _gpu).map(list) | _core.map(lambda c: [c]),
    }
)
_node = st.fixed_dictionaries(
    {"type": st.just("node"), "count": st.integers(1, 2), "with": _slot.map(lambda s: [s])}
)
_task = st.fixed_dictionaries(
    {
        "command": st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
        "slot": st.just("default"),
        "count": st.fixed_dictionaries({"per_slot": st.integers(1, 2)})
        | st.fixed_dictionaries({"total": st.integers(1, 4)}),
    }
)
_system = st.fixed_dictionaries(
    {"duration": st.floats(0, 1e7) | st.integers(0, 10**7)},
    optional={"queue": st.sampled_from(["gpu", "train"]), "cwd": st.just("/home/flux")},
)
jobspecs = corrupted(
    st.fixed_dictionaries(
        {
            "version": st.just(1),
            "resources": (_slot | _node).map(lambda r: [r]),
            "tasks": _task.map(lambda t: [t]),
            "attributes": st.fixed_dictionaries({"system": _system}, optional={"user": junk}),
        }
    ),
    most=2,
)
"""Flux RFC 25 V1 jobspecs (slot or node>slot, one task), then corrupted."""


_NAMED_CORE_FIELDS = {"type", "args", "kwargs", "meta", "queue", "id"}
_WORKFLOW_FIELDS = {"workflow_type", "steps", "jobs"}
_FLUX_FIELDS = {"version", "resources", "tasks", "attributes"}
_STEP = re.compile(r"^(steps|jobs)\[(\d+)\]\.")


def named_attribute(path: str, doc: Any) -> bool:
    """Whether a violation path names an attribute of `doc` (or the job, when it is no object).

    Accepted roots: ext_ml*/ext_mlx* keys, the project's own job keys (`ojs_ml_*`,
    e.g. `ojs_ml_gpu_share`), the core envelope fields, the workflow fields and the
    four Flux V1 keys; `<job>`/`<document>` only for a value that
    is not a mapping at all, where there is no attribute to name.
    """
    step = _STEP.match(path)
    if step is not None and isinstance(doc, Mapping):
        steps = doc.get(step.group(1))
        index = int(step.group(2))
        if isinstance(steps, list) and index < len(steps):
            return named_attribute(path[step.end() :], steps[index])
        return False
    root = re.split(r"[.\[]", path, maxsplit=1)[0]
    if root in ("<job>", "<document>"):
        return not isinstance(doc, Mapping)
    allowed = _NAMED_CORE_FIELDS | _WORKFLOW_FIELDS | _FLUX_FIELDS
    return root.startswith(("ext_ml", "ojs_ml_")) or root in allowed


def jobspec_text(doc: Any) -> str:
    """YAML text of a (possibly mutated) jobspec, as a user would write it."""
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


def example_paths() -> list[Path]:
    """Every example job file, JSON and YAML."""
    return sorted(JOBS_DIR.iterdir())
