"""The canonical requirement model: OJS ML Resources v0.3 `ext_ml_*` attributes.

One pydantic model holds every attribute of §3-§9 with its type, enum and range,
keyed by its wire name. Field-level rules (types, enums, formats) live on the
fields; cross-field rules and inference live in `normalize.py`, so the model can
be rebuilt from its own output and stay idempotent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StringConstraints,
)

Accelerator = Literal["gpu", "tpu", "fpga", "cpu"]
Interconnect = Literal["nvlink", "pcie", "any"]
TpuType = Literal["v4", "v5e", "v5p", "v6e"]
ModelProvider = Literal[
    "openai", "anthropic", "google", "huggingface", "replicate", "local", "custom"
]
ModelFormat = Literal["safetensors", "gguf", "onnx", "torchscript", "savedmodel", "custom"]
ModelRegistry = Literal["huggingface", "mlflow", "wandb", "s3", "gcs", "custom"]
Runtime = Literal["pytorch", "tensorflow", "onnx", "triton", "vllm", "tgi", "custom"]
Precision = Literal["fp32", "fp16", "bf16", "fp8", "int8", "int4"]
Strategy = Literal[
    "none", "data_parallel", "tensor_parallel", "pipeline_parallel", "fsdp", "deepspeed"
]
PriorityClass = Literal["spot", "on-demand", "reserved"]
Operator = Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Gte", "Lt", "Lte"]

GpuTypeId = Annotated[str, Strict(), StringConstraints(pattern=r"^[a-z0-9]+-[a-z0-9][a-z0-9.\-]*$")]
ComputeCapability = Annotated[str, Strict(), StringConstraints(pattern=r"^\d{1,2}\.\d{1,2}$")]
TpuTopology = Annotated[
    str, Strict(), StringConstraints(pattern=r"^[1-9]\d*x[1-9]\d*(x[1-9]\d*)?$")
]
Checksum = Annotated[str, Strict(), StringConstraints(pattern=r"^[a-z0-9]+:[0-9a-fA-F]+$")]
LabelKey = Annotated[
    str, Strict(), StringConstraints(pattern=r"^[A-Za-z0-9]([A-Za-z0-9_.\-/]{0,126}[A-Za-z0-9])?$")
]
LabelValue = Annotated[str, Strict(), StringConstraints(pattern=r"^[A-Za-z0-9_.\-:/+]{0,128}$")]
Text = Annotated[str, Strict(), StringConstraints(min_length=1, max_length=512)]
StrictNonNegInt = Annotated[int, Strict(), Field(ge=0)]
PositiveInt = Annotated[int, Strict(), Field(ge=1)]
GigaBytes = Annotated[float, Strict(), Field(ge=0)]


def _gpu_share(value: Any) -> Any:
    """`ojs_ml_gpu_share`: a bool, or a number in (0, 1); one message for every bad value."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float) and 0 < value < 1:
        return float(value)
    raise ValueError(f"must be true (share by VRAM) or a fraction in (0, 1), got {value!r:.40}")


GpuShare = Annotated[StrictBool | float, BeforeValidator(_gpu_share)]


class _Base(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
        hide_input_in_errors=True,
        allow_inf_nan=False,
    )


class AffinityRule(_Base):
    """One §7.2 rule: a label key, an operator and (for most operators) values."""

    key: LabelKey
    """Worker label the rule tests, e.g. `gpu_type` (OJS ML §7.2)."""
    operator: Operator
    """One of In, NotIn, Exists, DoesNotExist, Gt, Gte, Lt, Lte (OJS ML §7.2)."""
    values: tuple[LabelValue, ...] = ()
    """Values compared with the label; required except for Exists/DoesNotExist."""
    weight: Annotated[int, Strict()] | None = Field(default=None, ge=0, le=100)
    """Preference weight 0-100, preferred rules only (OJS ML §7.2)."""


class AffinitySpec(_Base):
    """§7.2/§7.3 rule lists: hard `required` and soft weighted `preferred`."""

    required: tuple[AffinityRule, ...] = ()
    """Hard constraints: every rule must hold on the worker (OJS ML §7.2)."""
    preferred: tuple[AffinityRule, ...] = ()
    """Soft constraints, scored by weight; never block dispatch (OJS ML §7.2)."""


class MLRequirements(_Base):
    """Every OJS ML Resources v0.3 attribute, by its wire name.

    Unknown `ext_ml_*` keys are kept in `model_extra` (forward compatibility).
    """

    model_config = ConfigDict(extra="allow")

    ext_ml_accelerator: Accelerator | None = None
    """Required accelerator: gpu, tpu, fpga, cpu; inferred from GPU/TPU fields (§3.1)."""
    ext_ml_gpu_type: GpuTypeId | None = None
    """GPU model id `{vendor}-{model}`, e.g. nvidia-a100 (§3.2)."""
    ext_ml_gpu_count: StrictNonNegInt | None = None
    """GPUs required; defaults to 1 when any GPU attribute is set (§3.2)."""
    ext_ml_gpu_memory_gb: Annotated[float, Strict(), Field(gt=0)] | None = None
    """Minimum VRAM per device, GB (§3.2)."""
    ext_ml_gpu_compute_capability: ComputeCapability | None = None
    """Minimum compute capability `major.minor`, compared as a version (§3.2)."""
    ext_ml_gpu_interconnect: Interconnect | None = None
    """Interconnect between allocated GPUs; ignored for one GPU (§3.2)."""
    ext_ml_tpu_type: TpuType | None = None
    """TPU version: v4, v5e, v5p, v6e (§3.3)."""
    ext_ml_tpu_topology: TpuTopology | None = None
    """Pod slice shape `AxB` or `AxBxC`; must agree with the chip count (§3.3)."""
    ext_ml_tpu_chip_count: PositiveInt | None = None
    """TPU chips required (§3.3)."""
    ext_ml_memory_gb: GigaBytes | None = None
    """Minimum host memory, GB (§3.4)."""
    ext_ml_storage_gb: GigaBytes | None = None
    """Minimum scratch storage, GB (§3.4)."""
    ext_ml_shm_size_gb: GigaBytes | None = None
    """Minimum /dev/shm size, GB (§3.4)."""
    ext_ml_cpu_cores: PositiveInt | None = None
    """Minimum CPU cores (§3.5)."""
    ext_ml_model_id: Text | None = None
    """Model identifier, used for routing and model locality (§4)."""
    ext_ml_model_version: Text | None = None
    """Model version; with a model id it pins workers to that version (§4)."""
    ext_ml_model_provider: ModelProvider | None = None
    """Model provider (§4)."""
    ext_ml_model_checksum: Checksum | None = None
    """Integrity checksum `algorithm:hexdigest` (§4)."""
    ext_ml_model_format: ModelFormat | None = None
    """Serialization format of the weights (§4)."""
    ext_ml_model_registry: ModelRegistry | None = None
    """Registry provider (§5.1)."""
    ext_ml_model_registry_uri: Text | None = None
    """Full URI of the model in the registry; validated against traversal/SSRF (§5.2, §15.2)."""
    ext_ml_max_tokens: PositiveInt | None = None
    """Maximum tokens for generation tasks (§6)."""
    ext_ml_max_batch_size: PositiveInt | None = None
    """Maximum inference batch size (§6)."""
    ext_ml_timeout_seconds: PositiveInt | None = None
    """Execution time limit, s; overrides the job timeout (§6, §14.3)."""
    ext_ml_runtime: Runtime | None = None
    """ML runtime (§6)."""
    ext_ml_precision: Precision | None = None
    """Compute precision; implies a minimum compute capability (§6)."""
    ext_ml_distributed_strategy: Strategy | None = None
    """Parallelism strategy (§6)."""
    ext_ml_node_selector: dict[LabelKey, LabelValue] | None = None
    """Labels a worker must all match (§7.1)."""
    ext_ml_affinity: AffinitySpec | None = None
    """Required and preferred affinity rules (§7.2)."""
    ext_ml_anti_affinity: AffinitySpec | None = None
    """Rules that must not hold on the worker or its running jobs (§7.3)."""
    ext_ml_priority_class: PriorityClass | None = None
    """spot < on-demand < reserved (§8.1)."""
    ext_ml_preemptible: StrictBool | None = None
    """Whether the job can be preempted; defaults from the priority class (§8.2)."""
    ext_ml_preemption_grace_period_s: StrictNonNegInt | None = None
    """Warning before forced preemption, s; default 30 (§8.2)."""
    ext_ml_checkpoint_on_preempt: StrictBool | None = None
    """Checkpoint during the grace period; default false (§8.2)."""
    ext_ml_reservation_id: Text | None = None
    """Pre-allocated reservation the job must run inside (§8.3)."""
    ext_ml_reservation_timeout_s: PositiveInt | None = None
    """Maximum seconds the reservation is held (§8.3)."""
    ext_ml_priority_escalation: StrictBool | None = None
    """Whether priority may escalate while waiting; default false (§8.4)."""
    ext_ml_escalation_after_s: PositiveInt | None = None
    """Queue time before escalation, s; default 3600 (§8.4)."""
    ext_ml_escalation_target_class: PriorityClass | None = None
    """Class to escalate to; must rank above the job's own (§8.4)."""
    ext_ml_checkpoint_enabled: StrictBool | None = None
    """Periodic checkpointing; default false (§9.1)."""
    ext_ml_checkpoint_interval_s: PositiveInt | None = None
    """Checkpoint interval, s; default 300 (§9.1)."""
    ext_ml_checkpoint_storage_uri: Text | None = None
    """Checkpoint prefix: s3/gs/az/file scheme, trailing slash (§9.4, §15.3)."""
    ext_ml_checkpoint_max_count: PositiveInt | None = None
    """Checkpoints kept, FIFO eviction; default 3 (§9.1)."""
    ojs_ml_gpu_share: GpuShare | None = None
    """celery-ojs-ml extension (docs/sharing.md), not an OJS ML attribute: run on a share
    of one GPU. `true`: `ext_ml_gpu_memory_gb` of VRAM; a number in (0, 1): that
    fraction of one device. Default: whole GPUs."""

    def flat(self) -> dict[str, Any]:
        """The set attributes as a JSON-able dict of wire names (unknown keys included)."""
        return self.model_dump(mode="json", exclude_defaults=True)


KNOWN_KEYS: frozenset[str] = frozenset(MLRequirements.model_fields)

PROJECT_KEYS: frozenset[str] = frozenset({"ojs_ml_gpu_share"})
"""Requirement keys of this project's own namespace, carried like `ext_ml_*` keys."""


def is_requirement_key(key: object) -> bool:
    """Whether a document or header key is a requirement: `ext_ml_*` or a `PROJECT_KEYS` one."""
    return isinstance(key, str) and (key.startswith("ext_ml_") or key in PROJECT_KEYS)


def gpu_share(m: MLRequirements) -> bool | float | None:
    """The job's GPU share: True (by VRAM), a fraction, or None (whole GPUs; `false` too)."""
    share = m.ojs_ml_gpu_share
    return None if share is False else share
