"""Where each OJS ML attribute is defined, and what a valid value looks like.

Every violation about an `ext_ml_*` attribute (or the project's `ojs_ml_*`
keys) cites its spec section (`section_of`) and shows a fix with a correct
value (`fix_for`, `EXAMPLES`).
"""

from __future__ import annotations

from celery_ojs_ml.spec import sharing
from celery_ojs_ml.spec.resources import PROJECT_KEYS

_SECTIONS = {
    "accelerator": "§3.1",
    "gpu": "§3.2",
    "tpu": "§3.3",
    "memory": "§3.4",
    "storage": "§3.4",
    "shm": "§3.4",
    "cpu": "§3.5",
    "model_registry": "§5.2",
    "model": "§4",
    "max": "§6",
    "timeout": "§6",
    "runtime": "§6",
    "precision": "§6",
    "distributed": "§6",
    "node": "§7.1",
    "affinity": "§7.2",
    "anti": "§7.3",
    "priority_class": "§8.1",
    "preempt": "§8.2",
    "checkpoint_on": "§8.2",
    "reservation": "§8.3",
    "priority_escalation": "§8.4",
    "escalation": "§8.4",
    "checkpoint": "§9.1",
}


EXAMPLES: dict[str, str] = {
    "ext_ml_accelerator": '"ext_ml_accelerator": "gpu"',
    "ext_ml_gpu_type": '"ext_ml_gpu_type": "nvidia-a100"',
    "ext_ml_gpu_count": '"ext_ml_gpu_count": 1',
    "ext_ml_gpu_memory_gb": '"ext_ml_gpu_memory_gb": 80',
    "ext_ml_gpu_compute_capability": '"ext_ml_gpu_compute_capability": "8.0"',
    "ext_ml_gpu_interconnect": '"ext_ml_gpu_interconnect": "nvlink"',
    "ext_ml_tpu_type": '"ext_ml_tpu_type": "v5e"',
    "ext_ml_tpu_topology": '"ext_ml_tpu_topology": "2x4"',
    "ext_ml_tpu_chip_count": '"ext_ml_tpu_chip_count": 8',
    "ext_ml_memory_gb": '"ext_ml_memory_gb": 64',
    "ext_ml_storage_gb": '"ext_ml_storage_gb": 500',
    "ext_ml_shm_size_gb": '"ext_ml_shm_size_gb": 16',
    "ext_ml_cpu_cores": '"ext_ml_cpu_cores": 8',
    "ext_ml_model_id": '"ext_ml_model_id": "llama-3.1-70b"',
    "ext_ml_model_version": '"ext_ml_model_version": "v2.1"',
    "ext_ml_model_checksum": '"ext_ml_model_checksum": "sha256:<64 hex digits>"',
    "ext_ml_model_registry_uri": '"ext_ml_model_registry_uri": "hf://org/model@main"',
    "ext_ml_timeout_seconds": '"ext_ml_timeout_seconds": 3600',
    "ext_ml_node_selector": '"ext_ml_node_selector": {"region": "us-east-1"}',
    "ext_ml_affinity": '"ext_ml_affinity": {"required": [{"key": "gpu_type", '
    '"operator": "In", "values": ["nvidia-a100"]}]}',
    "ext_ml_anti_affinity": '"ext_ml_anti_affinity": {"required": [{"key": "job_type", '
    '"operator": "In", "values": ["ml.train.large"]}]}',
    "ext_ml_priority_class": '"ext_ml_priority_class": "on-demand"',
    "ext_ml_preemption_grace_period_s": '"ext_ml_preemption_grace_period_s": 30',
    "ext_ml_escalation_target_class": '"ext_ml_escalation_target_class": "on-demand"',
    "ext_ml_checkpoint_storage_uri": '"ext_ml_checkpoint_storage_uri": "s3://bucket/checkpoints/"',
    "ext_ml_checkpoint_interval_s": '"ext_ml_checkpoint_interval_s": 300',
    "ext_ml_checkpoint_max_count": '"ext_ml_checkpoint_max_count": 3',
    "ojs_ml_gpu_share": sharing.EXAMPLE + ' (or a fraction, "ojs_ml_gpu_share": 0.25)',
}


def section_of(attribute: str) -> str:
    """The spec section that defines an `ext_ml_*` attribute, e.g. `OJS ML §3.2`."""
    if attribute in PROJECT_KEYS:
        return sharing.SECTION
    name = attribute.removeprefix("ext_ml_")
    best = max((k for k in _SECTIONS if name.startswith(k)), key=len, default="")
    return f"OJS ML {_SECTIONS[best]}" if best else "OJS ML §3"


def fix_for(attribute: str, path: str) -> str:
    """A fix that shows a correct value for the attribute."""
    example = EXAMPLES.get(attribute)
    if example:
        return f"set {path} to a valid value, e.g. {example}"
    return f"set {path} to a value of the type and range in the spec table"
