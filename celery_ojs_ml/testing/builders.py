"""Builders for test and demo values: `worker_with(gpus=4, gpu_type="nvidia-a100")`.

Builders construct the model directly (no parsing), with realistic defaults so
a test names only what it is about.
"""

from __future__ import annotations

from typing import Any

from celery_ojs_ml.capabilities.model import Capabilities, GpuCapability, TpuCapability


def worker_with(
    gpus: int = 0,
    gpu_type: str | None = "nvidia-a100",
    memory_gb: float | None = None,
    cc: str | None = None,
    interconnect: str | None = None,
    cpu_cores: int = 32,
    ram_gb: float = 256,
    labels: dict[str, str] | None = None,
    models: list[tuple[str, str | None]] | None = None,
    tpu: dict[str, Any] | None = None,
    **kw: Any,
) -> Capabilities:
    """A worker with `gpus` GPUs (0: CPU-only) and 32 cores / 256 GB by default.

    `memory_gb` and `cc` describe each GPU and default to the catalogue;
    other `Capabilities` fields (worker_id, storage_gb, ...) go through `kw`.
    """
    gpu = None
    if gpus > 0:
        fields = {"type": gpu_type, "count": gpus, "memory_gb": memory_gb}
        more = {"compute_capability": cc, "interconnect": interconnect}
        gpu = GpuCapability.model_validate({**fields, **more})
    loaded = [{"model_id": m, "model_version": v} for m, v in models or []]
    return Capabilities.model_validate(
        {
            "gpu": gpu,
            "tpu": TpuCapability.model_validate(tpu) if tpu else None,
            "cpu_cores": cpu_cores,
            "memory_gb": ram_gb,
            "labels": labels or {},
            "models_loaded": loaded,
            **kw,
        }
    )
