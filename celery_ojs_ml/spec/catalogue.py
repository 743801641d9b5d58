"""Well-known accelerator catalogue (OJS ML Resources v0.3 §3.2, §3.3, §6).

The tables are data, not logic: the normaliser uses them to infer compute
capability, capabilities use them to fill undeclared VRAM and compute
capability, and the validator uses them to reject contradictions such as a T4
asked to provide compute capability 8.0.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuModel:
    """One row of the §3.2 well-known GPU table."""

    id: str
    vendor: str
    memory_gb: tuple[float, ...]
    compute_capability: str | None

    @property
    def max_memory_gb(self) -> float:
        """The largest VRAM variant of the model, in GB."""
        return max(self.memory_gb)


GPU_MODELS: dict[str, GpuModel] = {
    m.id: m
    for m in (
        GpuModel("nvidia-a100", "nvidia", (40, 80), "8.0"),
        GpuModel("nvidia-h100", "nvidia", (80,), "9.0"),
        GpuModel("nvidia-h200", "nvidia", (141,), "9.0"),
        GpuModel("nvidia-l4", "nvidia", (24,), "8.9"),
        GpuModel("nvidia-l40s", "nvidia", (48,), "8.9"),
        GpuModel("nvidia-t4", "nvidia", (16,), "7.5"),
        GpuModel("nvidia-v100", "nvidia", (16, 32), "7.0"),
        GpuModel("nvidia-a10g", "nvidia", (24,), "8.6"),
        GpuModel("nvidia-b200", "nvidia", (192,), "10.0"),
        GpuModel("amd-mi250", "amd", (128,), None),
        GpuModel("amd-mi300x", "amd", (192,), None),
    )
}

#: §3.3 well-known TPU types and their HBM per chip in GB.
TPU_TYPES: dict[str, float] = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}

#: §6 minimum compute capability implied by a precision.
PRECISION_MIN_CC: dict[str, str] = {
    "fp32": "7.0",
    "fp16": "7.0",
    "bf16": "8.0",
    "fp8": "8.9",
    "int8": "7.5",
    "int4": "7.5",
}

#: §8.1 priority classes, lowest first; index is the rank.
PRIORITY_CLASSES: tuple[str, ...] = ("spot", "on-demand", "reserved")


_RANKS: dict[str, int] = {name: i for i, name in enumerate(PRIORITY_CLASSES)}


def priority_rank(priority_class: str) -> int:
    """The §8.1 rank of a priority class: reserved > on-demand > spot."""
    try:
        return _RANKS[priority_class]
    except (KeyError, TypeError):
        raise ValueError(f"{priority_class!r} is not a priority class {PRIORITY_CLASSES}") from None


def cc_tuple(value: str) -> tuple[int, int]:
    """A `major.minor` compute capability as a comparable tuple (10.0 > 9.0)."""
    major, _, minor = value.partition(".")
    return int(major), int(minor or 0)


def gpu_model(gpu_type: str | None) -> GpuModel | None:
    """The catalogue row for a GPU type id, or None when it is not well known."""
    return GPU_MODELS.get(gpu_type) if gpu_type else None
