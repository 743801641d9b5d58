"""Teaching error messages for capability documents.

Turns pydantic errors and rule breaks into `Violation`s that name the path in
the form the worker wrote (`capabilities.gpu.count` for the §11 object,
`labels[1]` for the v0.1 label list), say what is allowed and show a correct
example in that same form. Kept apart from the parser so the message table can
grow without crowding the shape detection.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from celery_ojs_ml.capabilities.model import (
    Capabilities,
    GpuCapability,
    LoadedModel,
    TpuCapability,
)
from celery_ojs_ml.errors import Violation

SECTION_11 = "OJS ML §11"
SECTION_LABELS = "OJS ML v0.1 §2.3"
SECTION_FETCH = "OJS ML v0.1 §6.1"


@dataclass(frozen=True, slots=True)
class Hint:
    """What a field allows and a correct example of it."""

    allowed: str
    example: Any
    label_key: str | None = None


HINTS: dict[str, Hint] = {
    "worker_id": Hint("a string id", "gpu-worker-01"),
    "accelerator": Hint("one of gpu, tpu, fpga, cpu", "gpu", "accelerator"),
    "gpu": Hint("an object", {"type": "nvidia-a100", "count": 8}),
    "gpu.type": Hint("a {vendor}-{model} id", "nvidia-a100", "gpu"),
    "gpu.count": Hint("a count >= 0", 8, "gpu_count"),
    "gpu.memory_gb": Hint("the VRAM of one device in GB, > 0", 80, "gpu_memory_gb"),
    "gpu.compute_capability": Hint('a "major.minor" version', "8.0", "compute_capability"),
    "gpu.interconnect": Hint("nvlink or pcie", "nvlink", "gpu_interconnect"),
    "tpu": Hint("an object", {"type": "v5e", "topology": "2x4"}),
    "tpu.type": Hint("a TPU version", "v5e", "tpu_type"),
    "tpu.topology": Hint("AxB or AxBxC", "2x4", "tpu_topology"),
    "tpu.chip_count": Hint("a count >= 1", 8, "tpu_chip_count"),
    "cpu": Hint("an object with cores", {"cores": 32}),
    "cpu.cores": Hint("a count >= 1", 32),
    "cpu_cores": Hint("a count >= 1", 32, "cpu_cores"),
    "memory_gb": Hint("the host memory in GB, >= 0", 256, "memory_gb"),
    "storage_gb": Hint("the scratch storage in GB, >= 0", 8000, "storage_gb"),
    "shm_size_gb": Hint("the /dev/shm size in GB, >= 0", 64, "shm_size_gb"),
    "models_loaded": Hint("a list of models", [{"model_id": "llama-3.1-8b"}]),
    "models_loaded.model_id": Hint("a model id", "llama-3.1-8b"),
    "models_loaded.model_version": Hint("a version string", "v2.1"),
    "models_loaded.model_format": Hint("a format name", "safetensors"),
    "model_registry_access": Hint("true or false", False),
    "runtimes": Hint("a list of runtime names", ["vllm", "pytorch"]),
    "model_formats": Hint("a list of model format names", ["gguf"]),
    "labels": Hint("string keys and values", {"region": "us-east-1"}),
    "gpu_devices": Hint(
        "one object per device of gpu.count, in allocation order",
        [{"type": "nvidia-a100", "memory_gb": 80}, {"type": "nvidia-t4", "memory_gb": 16}],
    ),
}

_OWNERS: dict[str, type[BaseModel]] = {
    "": Capabilities,
    "gpu": GpuCapability,
    "tpu": TpuCapability,
    "models_loaded": LoadedModel,
}


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the worker wrote a field: the path to show, and the text it wrote."""

    path: str
    text: str | None = None
    hint_field: str | None = None


@dataclass(frozen=True, slots=True)
class Form:
    """How the worker wrote its document: section, path prefix, field origins."""

    section: str
    prefix: str = "capabilities"
    origins: Mapping[str, Origin] = field(default_factory=dict)

    @property
    def is_labels(self) -> bool:
        """Whether paths point into a v0.1 label list."""
        return self.section == SECTION_LABELS


def show(value: Any) -> str:
    """A value as JSON, cut short so a message stays one line."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def hint_for(field_path: str) -> tuple[str, Hint] | None:
    """The hint of a field path and its key, falling back to parents (`labels.x` -> `labels`)."""
    key = re.sub(r"\[\d+\]", "", field_path)
    while key:
        if key in HINTS:
            return key, HINTS[key]
        key = key.rpartition(".")[0]
    return None


def fix_text(form: Form, field_path: str) -> str:
    """`set <allowed>, e.g. <example in the worker's own form>`."""
    found = hint_for(field_path)
    if found is None:
        return "see the example documents in OJS ML §11"
    key, hint = found
    if form.is_labels and hint.label_key:
        return f'set {hint.allowed}, e.g. "{hint.label_key}:{hint.example}"'
    return f'set {hint.allowed}, e.g. "{key.rpartition(".")[2]}": {json.dumps(hint.example)}'


def locate(form: Form, field_path: str) -> Origin:
    """Where the worker wrote a field (a label, `cpu.cores`) or its §11 path."""
    origin = form.origins.get(field_path)
    if origin is not None:
        return origin
    return Origin(f"{form.prefix}.{field_path}" if field_path else form.prefix)


def rule_violation(form: Form, field_path: str, problem: str, fix: str, section: str) -> Violation:
    """A broken rule about a field, placed where the worker wrote it."""
    return Violation(locate(form, field_path).path, problem, section, fix)


def from_validation_error(form: Form, err: ValidationError) -> list[Violation]:
    """One teaching violation per pydantic error."""
    return [_one(form, e["loc"], e["type"], e.get("input")) for e in err.errors()]


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _one(form: Form, loc: tuple[int | str, ...], kind: str, value: Any) -> Violation:
    field_path = _field_path(loc)
    origin = locate(form, field_path)
    if kind == "extra_forbidden":
        fix = _known_fields(field_path)
        return Violation(origin.path, "is not a known field", form.section, fix)
    problem = "is missing" if kind == "missing" else f"is {show(origin.text or value)}"
    fix = fix_text(form, origin.hint_field or field_path)
    return Violation(origin.path, problem, form.section, fix)


def _known_fields(field_path: str) -> str:
    parent, _, name = re.sub(r"\[\d+\]", "", field_path).rpartition(".")
    owner = _OWNERS.get(parent)
    if owner is None:
        return "remove it"
    names = list(owner.model_fields)
    close = difflib.get_close_matches(name, names, n=1)
    guess = f'did you mean "{close[0]}"? ' if close else ""
    return f"{guess}use one of {', '.join(names)}"
