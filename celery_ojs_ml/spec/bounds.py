"""The configurable per-job bounds and allow-lists (OJS ML §15, Extensions §12.1).

Key decision: the bounds are a frozen value of their own, apart from the
normaliser, so the rule modules the normaliser runs can name it without
importing the normaliser back.
"""

from __future__ import annotations

from dataclasses import dataclass

from celery_ojs_ml.spec.mlx import DEFAULT_ARTIFACT_SCHEMES


@dataclass(frozen=True, slots=True)
class Bounds:
    """Configurable upper bounds and allow-lists for one job (OJS ML §15, Extensions §12.1).

    Each field is the setting `ojs_ml_<field>` (docs/settings.md).
    """

    max_gpu_count: int = 64
    max_gpu_memory_gb: float = 1024
    max_tpu_chip_count: int = 4096
    max_cpu_cores: int = 1024
    max_memory_gb: float = 16384
    max_storage_gb: float = 1_000_000
    max_shm_size_gb: float = 4096
    max_timeout_seconds: int = 30 * 86400
    max_checkpoint_max_count: int = 1000
    checkpoint_schemes: frozenset[str] = frozenset({"s3", "gs", "az", "file"})
    checkpoint_prefixes: tuple[str, ...] = ()
    model_registry_schemes: frozenset[str] = frozenset(
        {"hf", "mlflow", "wandb", "s3", "gs", "az", "file"}
    )
    allowed_model_ids: frozenset[str] | None = None
    protected_label_keys: frozenset[str] = frozenset({"cost_center", "security_zone"})
    artifact_schemes: frozenset[str] = DEFAULT_ARTIFACT_SCHEMES
    """Schemes allowed in `ext_mlx_*` URIs (OJS ML Extensions §6, §12.1)."""
    artifact_prefixes: tuple[str, ...] = ()
    """When set, every `ext_mlx_*` URI must lie under one; the only way to allow `file://`
    URIs or internal hosts (OJS ML Extensions §12.1)."""


DEFAULT_BOUNDS = Bounds()
