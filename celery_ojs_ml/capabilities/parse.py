"""Read a worker capability document in any of its three spec forms.

The forms (the §11 advertisement or its inner object, the v0.1 §2.3 label list and
the v0.1 §6.1 FETCH `capabilities` object) are told apart by shape, since none of
them has a version field (`parse_capabilities`).

Key decision: all three are converted to the §11 shape and validated by the one
model, and every error is reported at the path the worker wrote (a label list
error names `labels[i]`). Unknown fields are rejected with a did-you-mean hint:
capability documents are written by hand, and a silently dropped `cpu_core`
would make the worker invisible to every job that asks for cores.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from celery_ojs_ml.capabilities._violations import (
    SECTION_11,
    SECTION_FETCH,
    SECTION_LABELS,
    Form,
    Origin,
    from_validation_error,
    rule_violation,
    show,
)
from celery_ojs_ml.capabilities.model import VRAM_SNAP, Capabilities, format_number
from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.spec.catalogue import gpu_model

#: v0.1 label keys that name a capability field; all other keys stay labels.
LABEL_FIELDS: dict[str, str] = {
    "accelerator": "accelerator",
    "gpu": "gpu.type",
    "gpu_type": "gpu.type",
    "gpu_count": "gpu.count",
    "gpu_memory_gb": "gpu.memory_gb",
    "compute_capability": "gpu.compute_capability",
    "gpu_compute_capability": "gpu.compute_capability",
    "gpu_interconnect": "gpu.interconnect",
    "tpu": "tpu.type",
    "tpu_type": "tpu.type",
    "tpu_topology": "tpu.topology",
    "tpu_chip_count": "tpu.chip_count",
    "cpu_cores": "cpu_cores",
    "memory_gb": "memory_gb",
    "storage_gb": "storage_gb",
    "shm_size_gb": "shm_size_gb",
}


def parse_capabilities(doc: Any, *, worker_id: str | None = None) -> Capabilities:
    """Capabilities from a §11, v0.1 label or v0.1 FETCH document.

    * the §11 advertisement `{"worker_id": ..., "capabilities": {...}}` or the bare
      inner object (`accelerator`, `gpu{...}`, `cpu_cores`, ..., plus `tpu{...}`);
    * the v0.1 §2.3 label list `["gpu:nvidia-a100", "gpu_count:4", ...]`, bare or as
      `{"worker_id": ..., "labels": [...]}`; known keys become fields, the rest stay
      labels;
    * the v0.1 §6.1 FETCH `capabilities` object, told apart by its `cpu: {cores}`.

    `worker_id` is used only when the document names no worker. Raises
    `SpecError` listing every problem at the path the worker wrote.
    """
    if isinstance(doc, Capabilities):
        return _with_worker_id(doc, worker_id)
    if isinstance(doc, list):
        return _parse_labels(doc, worker_id, prefix="labels")
    if not isinstance(doc, dict):
        raise SpecError(_not_a_document(doc))
    own_id = _worker_id(doc, worker_id)
    if "capabilities" in doc:
        return _parse_object(doc["capabilities"], own_id)
    if isinstance(doc.get("labels"), list):
        return _parse_labels(doc["labels"], own_id, prefix="labels")
    return _parse_object(doc, own_id)


def capabilities_to_dict(c: Capabilities) -> dict[str, Any]:
    """The canonical §11 advertisement: JSON-able, parses back to an equal value."""
    inner = c.model_dump(mode="json", exclude_none=True, exclude={"worker_id"})
    for key in ("models_loaded", "runtimes", "model_formats", "labels", "gpu_devices"):
        if not inner[key]:
            del inner[key]
    if not inner["model_registry_access"]:
        del inner["model_registry_access"]
    inner = _whole_numbers(inner)
    return (
        {"worker_id": c.worker_id, "capabilities": inner}
        if c.worker_id
        else {"capabilities": inner}
    )


def _whole_numbers(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _with_worker_id(c: Capabilities, worker_id: str | None) -> Capabilities:
    if c.worker_id or not worker_id:
        return c
    return c.model_copy(update={"worker_id": worker_id})


def _not_a_document(doc: Any) -> Violation:
    return Violation(
        "capabilities",
        f"is {show(doc)}",
        SECTION_11,
        'pass the §11 object, e.g. {"capabilities": {"gpu": {"type": "nvidia-a100", "count": 8}}}',
    )


def _worker_id(doc: dict[str, Any], fallback: str | None) -> str | None:
    value = doc.get("worker_id")
    if value is None:
        return fallback
    if not isinstance(value, str):
        raise SpecError(
            Violation(
                "worker_id",
                f"is {show(value)}",
                SECTION_11,
                'set a string id, e.g. "worker_id": "gpu-worker-01"',
            )
        )
    return value


def _parse_object(inner: Any, worker_id: str | None) -> Capabilities:
    if not isinstance(inner, dict):
        raise SpecError(_not_a_document(inner))
    data = dict(inner)
    form = Form(SECTION_11)
    if "cpu" in data:
        cores = Origin("capabilities.cpu.cores", hint_field="cpu.cores")
        form = Form(SECTION_FETCH, origins={"cpu_cores": cores})
        _fold_cpu(data, form)
    if worker_id is not None and data.get("worker_id") is None:
        data["worker_id"] = worker_id
    return _validate(data, form)


def _fold_cpu(data: dict[str, Any], form: Form) -> None:
    """v0.1 §6.1 `cpu: {"cores": N}` becomes the §11 `cpu_cores: N`."""
    cpu = data.pop("cpu")
    fix = 'set an object with cores, e.g. "cpu": {"cores": 32}'
    if not isinstance(cpu, dict) or set(cpu) - {"cores"}:
        raise SpecError(rule_violation(form, "cpu", f"is {show(cpu)}", fix, form.section))
    if "cpu_cores" in data and "cores" in cpu:
        problem = "and cpu_cores are both set"
        fix = 'give one of them, e.g. "cpu": {"cores": 32}'
        raise SpecError(rule_violation(form, "cpu", problem, fix, form.section))
    if "cores" in cpu:
        data["cpu_cores"] = cpu["cores"]


def _parse_labels(items: list[Any], worker_id: str | None, *, prefix: str) -> Capabilities:
    data: dict[str, Any] = {"worker_id": worker_id} if worker_id else {}
    origins: dict[str, Origin] = {}
    problems = [
        problem
        for index, item in enumerate(items)
        if (problem := _add_label(data, origins, index, item, prefix)) is not None
    ]
    gpu = data.get("gpu")
    if isinstance(gpu, dict) and "count" not in gpu:
        gpu["count"] = 1
    caps, more = _check(data, Form(SECTION_LABELS, prefix, origins))
    if problems or caps is None:
        raise SpecError(problems + more)
    return caps


def _add_label(
    data: dict[str, Any],
    origins: dict[str, Origin],
    index: int,
    item: Any,
    prefix: str,
) -> Violation | None:
    path = f"{prefix}[{index}]"
    key, _, value = item.partition(":") if isinstance(item, str) else ("", "", "")
    key, value = key.strip(), value.strip()
    if not key or ":" not in item:
        fix = 'write each label as "key:value", e.g. "region:us-east-1"'
        return Violation(path, f"is {show(item)}", SECTION_LABELS, fix)
    target = LABEL_FIELDS.get(key, f"labels.{key}")
    if target in origins and _get(data, target) != value:
        first = origins[target]
        first_key = (first.text or "").partition(":")[0]
        problem = f'is {show(item)} but {first.path} already set "{first_key}"'
        return Violation(path, problem, SECTION_LABELS, "give each key one value")
    origins.setdefault(target, Origin(path, item))
    _put(data, target, value)
    return None


def _get(data: dict[str, Any], target: str) -> Any:
    head, _, leaf = target.rpartition(".")
    return (data.get(head, {}) if head else data).get(leaf)


def _put(data: dict[str, Any], target: str, value: str) -> None:
    head, _, leaf = target.rpartition(".")
    (data.setdefault(head, {}) if head else data)[leaf] = value


def _validate(data: dict[str, Any], form: Form) -> Capabilities:
    caps, problems = _check(data, form)
    if caps is None:
        raise SpecError(problems)
    return caps


def _check(data: dict[str, Any], form: Form) -> tuple[Capabilities | None, list[Violation]]:
    """The capabilities, or None and every violation found."""
    try:
        caps = Capabilities.model_validate(data)
    except ValidationError as err:
        return None, from_validation_error(form, err)
    problems = consistency_violations(caps, form)
    return (None, problems) if problems else (caps, [])


def consistency_violations(c: Capabilities, form: Form | None = None) -> list[Violation]:
    """Declared values that contradict each other or the §3.2 catalogue."""
    form = form or Form(SECTION_11)
    return _accelerator_violations(c, form) + _catalogue_violations(c, form)


def _accelerator_violations(c: Capabilities, form: Form) -> list[Violation]:
    declared, gpus = c.accelerator, c.gpu_count
    if declared == "gpu" and gpus == 0:
        fix = 'declare the GPUs, e.g. "gpu": {"type": "nvidia-a100", "count": 8}'
        return [
            rule_violation(form, "accelerator", 'is "gpu" but gpu.count is 0', fix, "OJS ML §3.1")
        ]
    if declared == "tpu" and c.tpu is None:
        fix = 'declare the TPU slice, e.g. "tpu": {"type": "v5e", "topology": "2x4"}'
        return [
            rule_violation(form, "accelerator", 'is "tpu" but no tpu is set', fix, "OJS ML §3.1")
        ]
    if declared in ("cpu", "fpga") and gpus > 0:
        problem = f'is "{declared}" but gpu.count is {gpus}'
        fix = 'leave accelerator out to infer it, or set it to match, e.g. "accelerator": "gpu"'
        return [rule_violation(form, "accelerator", problem, fix, "OJS ML §3.1")]
    return []


def _catalogue_violations(c: Capabilities, form: Form) -> list[Violation]:
    row = gpu_model(c.gpu.type) if c.gpu else None
    if c.gpu is None or row is None:
        return []
    out: list[Violation] = []
    cc = c.gpu.compute_capability
    if row.compute_capability and cc and cc != row.compute_capability:
        problem = f'is "{cc}" but {row.id} has {row.compute_capability}'
        fix = f'leave it out or set it, e.g. "compute_capability": "{row.compute_capability}"'
        out.append(rule_violation(form, "gpu.compute_capability", problem, fix, "OJS ML §3.2"))
    memory = c.gpu.memory_gb
    if memory and memory > row.max_memory_gb * (1 + VRAM_SNAP):
        most = format_number(row.max_memory_gb)
        problem = f"is {format_number(memory)} but {row.id} has at most {most} GB"
        fix = f'declare the VRAM of one device, e.g. "memory_gb": {most}'
        out.append(rule_violation(form, "gpu.memory_gb", problem, fix, "OJS ML §3.2"))
    return out
