"""The worker capability model (OJS ML Resources v0.3 §11, §3.2, §3.3).

One frozen pydantic model describes what a worker has. Key decisions:

* Values the worker leaves out for a well-known GPU are filled from the §3.2
  catalogue; declared values always win. VRAM is filled with the *smallest*
  variant (an A100 of unknown size counts as 40 GB), because overclaiming VRAM
  sends jobs that then die with CUDA OOM, while underclaiming only loses a match.
* `derived_labels()` is the label map node selectors and affinity rules (§7.1,
  v0.1 §3) match: own labels plus keys derived from the hardware, which always win,
  so no label can make an A100 worker look like an H100 one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from celery_ojs_ml.spec.catalogue import gpu_model

Accelerator = Literal["gpu", "tpu", "fpga", "cpu"]
Interconnect = Literal["nvlink", "pcie"]

CC_PATTERN = r"^\d+\.\d+$"
TOPOLOGY_PATTERN = r"^\d+x\d+(x\d+)?$"
GPU_TYPE_PATTERN = r"^[a-z0-9]+-[a-z0-9][a-z0-9.-]*$"

#: How far a VRAM figure may stray from a §3.2 catalogue variant and still be that
#: variant: probes snap readings within it, declarations may exceed the largest by it.
VRAM_SNAP = 0.10


def format_number(value: float) -> str:
    """A number in canonical label form: `80` for 80.0, `79.6` stays `79.6`."""
    if isinstance(value, bool):
        return str(value).lower()
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _cc_from_number(value: Any) -> Any:
    """Accept `8` or `8.6` for a compute capability and keep it `major.minor`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return f"{value}.0"
    if isinstance(value, float):
        return repr(value)
    return value


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _label_value(value: Any) -> Any:
    """Labels are strings; JSON `true` and `80` become `"true"` and `"80"`."""
    if isinstance(value, bool | int | float):
        return format_number(value)
    return value


def _labels(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _label_value(v) for k, v in value.items()}
    return value


CCString = Annotated[str, BeforeValidator(_cc_from_number), Field(pattern=CC_PATTERN)]
GpuType = Annotated[str, BeforeValidator(_lower), Field(pattern=GPU_TYPE_PATTERN)]
Labels = Annotated[dict[str, str], BeforeValidator(_labels)]


class CapabilityModel(BaseModel):
    """Shared config: frozen, unknown keys rejected, strings stripped."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        str_strip_whitespace=True,
        use_attribute_docstrings=True,
        protected_namespaces=(),
    )


class GpuCapability(CapabilityModel):
    """The worker's GPUs (§11 `capabilities.gpu`); all devices share these values."""

    type: GpuType | None = None
    """§3.2 GPU type id such as `nvidia-a100`; lower-cased. None: unknown model."""
    count: int = Field(ge=0)
    """§11 number of GPU devices on the worker; 0 means none."""
    memory_gb: float | None = Field(default=None, gt=0)
    """§3.2 VRAM per device in GB; filled with the smallest catalogue variant if undeclared."""
    compute_capability: CCString | None = None
    """§3.2 NVIDIA compute capability, `major.minor`; filled from the catalogue if undeclared."""
    interconnect: Interconnect | None = None
    """§3.2 link between the devices: `nvlink` or `pcie`; None when unknown or single GPU."""
    nvlink_group: int | None = Field(default=None, ge=2)
    """The most devices that are all NVLink peers of each other, when fewer than `count`
    (the probe reads it from NVML: bridged pairs give 2); None: all of them."""

    @model_validator(mode="before")
    @classmethod
    def _fill_from_catalogue(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        gpu_type = data.get("type")
        row = gpu_model(_lower(gpu_type)) if isinstance(gpu_type, str) else None
        if row is None:
            return data
        filled = dict(data)
        if filled.get("memory_gb") is None:
            filled["memory_gb"] = min(row.memory_gb)
        if filled.get("compute_capability") is None and row.compute_capability:
            filled["compute_capability"] = row.compute_capability
        return filled


class GpuDeviceFact(CapabilityModel):
    """One device of a host whose GPUs differ (§11 `gpu_devices`, in allocation order):
    two models, or MIG devices (`capabilities.devices`)."""

    type: GpuType | None = None
    """§3.2 GPU type id of the device (a MIG device: its GPU's), e.g. `nvidia-t4`."""
    memory_gb: float = Field(gt=0)
    """The device's own memory in GB (a MIG device: its slice)."""
    compute_capability: CCString | None = None
    """§3.2 compute capability of the device."""
    mig: bool = False
    """A MIG device: CUDA gives a process one, so it serves only 1-GPU jobs."""


class TpuCapability(CapabilityModel):
    """The worker's TPU slice (§3.3), advertised next to §11 `gpu` as `tpu`."""

    type: Annotated[str, BeforeValidator(_lower), Field(min_length=1)]
    """§3.3 TPU version such as `v5e`."""
    topology: str | None = Field(default=None, pattern=TOPOLOGY_PATTERN)
    """§3.3 pod slice shape, `AxB` or `AxBxC` (e.g. `2x4`)."""
    chip_count: int = Field(ge=1)
    """§3.3 number of TPU chips; the product of the topology when not declared."""

    @model_validator(mode="before")
    @classmethod
    def _chips_from_topology(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("chip_count") is not None:
            return data
        topology = data.get("topology")
        if not isinstance(topology, str):
            return data
        if not re.match(TOPOLOGY_PATTERN, topology.strip()):
            # Only the topology error is worth showing; 1 stands in and never escapes.
            return {**data, "chip_count": 1}
        return {**data, "chip_count": math.prod(int(s) for s in topology.strip().split("x"))}


class LoadedModel(CapabilityModel):
    """One entry of §11 `models_loaded` (model identity after §4)."""

    model_id: str = Field(min_length=1)
    """§4 `ext_ml_model_id` of a model the worker holds, e.g. `llama-3.1-8b`."""
    model_version: str | None = None
    """§4 `ext_ml_model_version` of the loaded copy; None when unversioned."""
    model_format: str | None = None
    """§4 `ext_ml_model_format`, e.g. `safetensors`."""

    @model_validator(mode="before")
    @classmethod
    def _from_id(cls, data: Any) -> Any:
        return {"model_id": data} if isinstance(data, str) else data


def _infer_accelerator(data: Any) -> Any:
    """§3.1 inference applied to a worker: gpu if it has GPUs, tpu if a TPU, else cpu."""
    if not isinstance(data, dict) or data.get("accelerator") is not None:
        return data
    return {**data, "accelerator": _accelerator_of(data.get("gpu"), data.get("tpu"))}


def _accelerator_of(gpu: Any, tpu: Any) -> Accelerator:
    count = gpu.count if isinstance(gpu, GpuCapability) else None
    if isinstance(gpu, dict):
        try:
            count = int(gpu.get("count") or 0)
        except (TypeError, ValueError):
            count = None
    if count:
        return "gpu"
    return "tpu" if tpu is not None else "cpu"


class Capabilities(CapabilityModel):
    """Everything a worker advertises (§11), in one frozen value."""

    worker_id: str | None = None
    """§11 `worker_id`; None until the worker knows its name."""
    accelerator: Accelerator
    """§3.1 accelerator kind; inferred when not declared (gpu > tpu > cpu)."""
    gpu: GpuCapability | None = None
    """§11 `gpu` object; None on a worker without GPUs."""
    tpu: TpuCapability | None = None
    """§3.3 TPU slice of a TPU worker; None otherwise."""
    cpu_cores: int | None = Field(default=None, ge=1)
    """§3.5 logical CPU cores."""
    memory_gb: float | None = Field(default=None, ge=0)
    """§3.4 host memory in GB."""
    storage_gb: float | None = Field(default=None, ge=0)
    """§3.4 scratch storage in GB."""
    shm_size_gb: float | None = Field(default=None, ge=0)
    """§3.4 size of `/dev/shm` in GB."""
    models_loaded: tuple[LoadedModel, ...] = ()
    """§11 models the worker holds (§4 model locality)."""
    model_registry_access: bool = False
    """§4: True declares the worker can fetch any model version from its registry; by
    default (False) it serves a pinned version (`ext_ml_model_id` + `ext_ml_model_version`)
    only when that version is in `models_loaded`."""
    runtimes: tuple[str, ...] = ()
    """§11 runtimes installed on the worker, e.g. `vllm`, `pytorch`; a job's §6
    `ext_ml_runtime` must be one of them (`capabilities.runtimes`)."""
    model_formats: tuple[str, ...] = ()
    """§4 model formats the worker loads besides those its runtimes load natively
    (`capabilities.runtimes.RUNTIME_FORMATS`), e.g. `gguf` for a custom runtime."""
    labels: Labels = Field(default_factory=dict)
    """§11 free-form labels for node selectors and affinity (§7)."""
    gpu_devices: tuple[GpuDeviceFact, ...] = ()
    """Each GPU's own facts when they differ (a mixed host, MIG), one per device of
    `gpu.count`; jobs are matched and allocated against these (`capabilities.devices`)."""

    _derived: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _accelerator(cls, data: Any) -> Any:
        return _infer_accelerator(data)

    @field_validator("gpu_devices")
    @classmethod
    def _one_per_device(
        cls, devices: tuple[GpuDeviceFact, ...], info: ValidationInfo
    ) -> tuple[GpuDeviceFact, ...]:
        gpu = info.data.get("gpu")
        count = gpu.count if isinstance(gpu, GpuCapability) else 0
        if devices and len(devices) != count:
            raise ValueError(f"lists {len(devices)} devices but gpu.count is {count}")
        return devices

    def model_post_init(self, context: Any, /) -> None:
        self._derived = _derive_labels(self)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy whose derived labels follow the updated fields (not validated)."""
        copied = super().model_copy(update=update, deep=deep)
        copied._derived = _derive_labels(copied)
        return copied

    @property
    def gpu_count(self) -> int:
        """Number of GPU devices; 0 without GPUs."""
        return self.gpu.count if self.gpu else 0

    def derived_labels(self) -> dict[str, str]:
        """Own labels plus hardware-derived keys, which always win (see module doc); the
        map is computed once, at construction."""
        return dict(self._derived)


def _hardware_labels(c: Capabilities) -> dict[str, str | float | int | None]:
    gpu, tpu = c.gpu, c.tpu
    return {
        "accelerator": c.accelerator,
        "gpu_type": gpu.type if gpu else None,
        "gpu_count": c.gpu_count,
        "gpu_memory_gb": gpu.memory_gb if gpu else None,
        "compute_capability": gpu.compute_capability if gpu else None,
        "gpu_interconnect": gpu.interconnect if gpu else None,
        "tpu_type": tpu.type if tpu else None,
        "tpu_topology": tpu.topology if tpu else None,
        "tpu_chip_count": tpu.chip_count if tpu else None,
        "cpu_cores": c.cpu_cores,
        "memory_gb": c.memory_gb,
        "storage_gb": c.storage_gb,
        "shm_size_gb": c.shm_size_gb,
        "worker_id": c.worker_id,
    }


def _derive_labels(c: Capabilities) -> dict[str, str]:
    labels = dict(c.labels)
    for key, value in _hardware_labels(c).items():
        if value is None:
            labels.pop(key, None)
        else:
            labels[key] = value if isinstance(value, str) else format_number(value)
    return labels
