"""Requirement classes: the hash of a job's hard constraints, and its band.

Key decision: only hard constraints enter the class (OJS ML §11: GPU type,
count, VRAM, compute capability, TPU, node selector, required affinity, plus
host minimums, multi-GPU interconnect, pinned model version, runtime and model
format (§6, §4), reservation and a GPU share `ojs_ml_gpu_share`), so jobs that any
worker would treat identically
share one queue. Soft constraints (preferred affinity, model locality) never split a class.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from celery_ojs_ml.spec.resources import AffinitySpec, MLRequirements

BANDS = ("reserved", "on-demand", "spot")
_SCALARS = (
    "ext_ml_gpu_type",
    "ext_ml_gpu_count",
    "ext_ml_gpu_memory_gb",
    "ext_ml_gpu_compute_capability",
    "ext_ml_tpu_type",
    "ext_ml_tpu_topology",
    "ext_ml_tpu_chip_count",
    "ext_ml_memory_gb",
    "ext_ml_storage_gb",
    "ext_ml_shm_size_gb",
    "ext_ml_cpu_cores",
    "ext_ml_reservation_id",
    "ext_ml_runtime",
    "ext_ml_model_format",
    "ojs_ml_gpu_share",
)


def hard_constraints(m: MLRequirements) -> dict[str, Any]:
    """The canonical hard constraints of a job, JSON-able and order-free."""
    out: dict[str, Any] = {k: getattr(m, k) for k in _SCALARS if getattr(m, k) is not None}
    if m.ojs_ml_gpu_share is False:  # `false` is the default (whole GPUs)
        del out["ojs_ml_gpu_share"]
    if m.ext_ml_accelerator in ("gpu", "tpu", "fpga"):
        out["ext_ml_accelerator"] = m.ext_ml_accelerator
    if (m.ext_ml_gpu_count or 0) > 1 and m.ext_ml_gpu_interconnect == "nvlink":
        out["ext_ml_gpu_interconnect"] = m.ext_ml_gpu_interconnect
    if m.ext_ml_model_id and m.ext_ml_model_version:
        out["ext_ml_model_id"] = m.ext_ml_model_id
        out["ext_ml_model_version"] = m.ext_ml_model_version
    if m.ext_ml_node_selector:
        out["ext_ml_node_selector"] = dict(sorted(m.ext_ml_node_selector.items()))
    for attr in ("ext_ml_affinity", "ext_ml_anti_affinity"):
        rules = _required(getattr(m, attr))
        if rules:
            out[attr] = rules
    return out


def _required(spec: AffinitySpec | None) -> list[dict[str, Any]]:
    if spec is None:
        return []
    rules = [
        {"key": r.key, "operator": r.operator, "values": sorted(r.values)} for r in spec.required
    ]
    return sorted(rules, key=lambda r: json.dumps(r, sort_keys=True))


def has_hard_constraints(m: MLRequirements) -> bool:
    """Whether the job needs routing at all; plain jobs keep their normal queue."""
    return bool(hard_constraints(m))


def class_id(m: MLRequirements) -> str:
    """A short stable id of the job's hard constraints (16 hex digits)."""
    blob = json.dumps(hard_constraints(m), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def band(m: MLRequirements) -> str:
    """The priority band of the job's queue: reserved, on-demand (default) or spot."""
    return m.ext_ml_priority_class or "on-demand"


def queue_name(logical_queue: str, m: MLRequirements) -> str:
    """`<logical queue>.ml.<class>.<band>`, the queue a constrained job is routed to."""
    return f"{logical_queue}.ml.{class_id(m)}.{band(m)}"
