"""Cross-field rules and inference for OJS ML v0.3 requirements.

Each check is a small function returning violations, so the list reads like the
spec. Inference follows the SHOULDs we adopt: the accelerator from GPU/TPU
fields (§3.1), one GPU by default (§3.2), compute capability from precision
(§6), preemptibility from the priority class (§8.2) and the §8.4/§9.1 defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from celery_ojs_ml.errors import Violation
from celery_ojs_ml.spec import sharing, uris
from celery_ojs_ml.spec.catalogue import (
    PRECISION_MIN_CC,
    PRIORITY_CLASSES,
    cc_tuple,
    gpu_model,
    priority_rank,
)
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share
from celery_ojs_ml.spec.rules_labels import label_checks
from celery_ojs_ml.spec.rules_sections import EXAMPLES as EXAMPLES
from celery_ojs_ml.spec.rules_sections import fix_for as fix_for
from celery_ojs_ml.spec.rules_sections import section_of as section_of

if TYPE_CHECKING:
    from celery_ojs_ml.spec.bounds import Bounds

_GPU_DETAIL = ("ext_ml_gpu_type", "ext_ml_gpu_memory_gb", "ext_ml_gpu_compute_capability")
CHECKSUM_HEX_DIGITS = {
    "md5": 32,
    "sha1": 40,
    "sha224": 56,
    "sha256": 64,
    "sha384": 96,
    "sha512": 128,
    "blake2b": 128,
    "blake2s": 64,
}
"""`ext_ml_model_checksum` algorithms (OJS ML §4) and their hex digest lengths: what every
worker can compute with Python's hashlib (`child.model_files`)."""
_NOT_COMPUTABLE = {"blake3": "Python's hashlib has no blake3, so no worker could verify it"}


def _v(attr: str, problem: str, fix: str, path: str | None = None) -> Violation:
    return Violation(path or attr, problem, section_of(attr), fix)


# -- checks ------------------------------------------------------------------------------------


def wants_gpu(m: MLRequirements) -> bool:
    """Whether the job asks for GPUs, explicitly or through GPU attributes (§3.1)."""
    if m.ext_ml_gpu_count is not None:
        return m.ext_ml_gpu_count > 0
    if m.ext_ml_accelerator == "gpu" or gpu_share(m) is not None:
        return True
    return any(getattr(m, k) is not None for k in (*_GPU_DETAIL, "ext_ml_gpu_interconnect"))


def wants_tpu(m: MLRequirements) -> bool:
    """Whether the job asks for a TPU (§3.1, §3.3)."""
    tpu_fields = (m.ext_ml_tpu_type, m.ext_ml_tpu_topology, m.ext_ml_tpu_chip_count)
    return m.ext_ml_accelerator == "tpu" or any(v is not None for v in tpu_fields)


def _gpu_count_zero(m: MLRequirements, b: Bounds) -> Iterator[Violation]:
    if m.ext_ml_gpu_count != 0:
        return
    for key in _GPU_DETAIL:
        if getattr(m, key) is not None:
            yield _v(
                "ext_ml_gpu_count",
                f"is 0 but {key} is set",
                f'set ext_ml_gpu_count >= 1, e.g. "ext_ml_gpu_count": 1, or remove {key}',
            )
    if m.ext_ml_accelerator == "gpu":
        yield _v(
            "ext_ml_gpu_count",
            'is 0 but ext_ml_accelerator is "gpu"',
            'set ext_ml_gpu_count >= 1, e.g. "ext_ml_gpu_count": 1',
        )


def _accelerator_conflicts(m: MLRequirements, b: Bounds) -> Iterator[Violation]:
    acc = m.ext_ml_accelerator
    if acc not in (None, "gpu") and wants_gpu(m):
        yield _v(
            "ext_ml_accelerator",
            f'is "{acc}" but GPU attributes are set',
            'set "ext_ml_accelerator": "gpu" or remove the ext_ml_gpu_* attributes',
        )
    if acc not in (None, "tpu") and wants_tpu(m):
        yield _v(
            "ext_ml_accelerator",
            f'is "{acc}" but TPU attributes are set',
            'set "ext_ml_accelerator": "tpu" or remove the ext_ml_tpu_* attributes',
        )
    if acc is None and wants_gpu(m) and wants_tpu(m):
        yield _v(
            "ext_ml_accelerator",
            "cannot be inferred: both GPU and TPU attributes are set",
            "ask for one accelerator: keep the ext_ml_gpu_* or the ext_ml_tpu_* attributes",
        )


def _tpu_topology(m: MLRequirements, b: Bounds) -> Iterator[Violation]:
    topo, chips = m.ext_ml_tpu_topology, m.ext_ml_tpu_chip_count
    if topo is None or chips is None:
        return
    product = topology_chips(topo)
    if product != chips:
        yield _v(
            "ext_ml_tpu_chip_count",
            f"is {chips} but ext_ml_tpu_topology {topo} has {product} chips",
            f'make them agree, e.g. "ext_ml_tpu_topology": "{topo}", '
            f'"ext_ml_tpu_chip_count": {product}',
        )


def topology_chips(topology: str) -> int:
    """The number of chips in an `AxB` or `AxBxC` topology."""
    product = 1
    for dim in topology.split("x"):
        product *= int(dim)
    return product


def required_cc(m: MLRequirements) -> str | None:
    """The minimum compute capability: declared, else implied by precision (§6)."""
    if m.ext_ml_gpu_compute_capability is not None:
        return m.ext_ml_gpu_compute_capability
    if m.ext_ml_precision is not None and wants_gpu(m):
        return PRECISION_MIN_CC[m.ext_ml_precision]
    return None


def _catalogue_contradictions(m: MLRequirements, b: Bounds) -> Iterator[Violation]:
    model = gpu_model(m.ext_ml_gpu_type)
    if model is None:
        return
    cc = required_cc(m)
    if cc and model.compute_capability and cc_tuple(cc) > cc_tuple(model.compute_capability):
        source = "" if m.ext_ml_gpu_compute_capability else f" (implied by {m.ext_ml_precision})"
        yield _v(
            "ext_ml_gpu_compute_capability",
            f"{cc}{source} exceeds {model.id}'s compute capability "
            f"{model.compute_capability}, so no worker could ever run the job",
            "ask for a GPU type that has it or lower the requirement, e.g. "
            '"ext_ml_gpu_type": "nvidia-h100"',
        )
    mem = m.ext_ml_gpu_memory_gb
    if mem is not None and mem > model.max_memory_gb:
        yield _v(
            "ext_ml_gpu_memory_gb",
            f"{_num(mem)} exceeds {model.id}'s largest VRAM of {_num(model.max_memory_gb)} GB",
            f'ask for at most "ext_ml_gpu_memory_gb": {_num(model.max_memory_gb)} '
            "or a larger GPU type",
        )


def _bounds(m: MLRequirements, b: Bounds) -> Iterator[Violation]:
    limits: tuple[tuple[str, float | int | None, float], ...] = (
        ("ext_ml_gpu_count", m.ext_ml_gpu_count, b.max_gpu_count),
        ("ext_ml_gpu_memory_gb", m.ext_ml_gpu_memory_gb, b.max_gpu_memory_gb),
        ("ext_ml_tpu_chip_count", m.ext_ml_tpu_chip_count, b.max_tpu_chip_count),
        ("ext_ml_cpu_cores", m.ext_ml_cpu_cores, b.max_cpu_cores),
        ("ext_ml_memory_gb", m.ext_ml_memory_gb, b.max_memory_gb),
        ("ext_ml_storage_gb", m.ext_ml_storage_gb, b.max_storage_gb),
        ("ext_ml_shm_size_gb", m.ext_ml_shm_size_gb, b.max_shm_size_gb),
        ("ext_ml_timeout_seconds", m.ext_ml_timeout_seconds, b.max_timeout_seconds),
        ("ext_ml_checkpoint_max_count", m.ext_ml_checkpoint_max_count, b.max_checkpoint_max_count),
    )
    for attr, value, limit in limits:
        if value is not None and value > limit:
            yield Violation(
                attr,
                f"is {_num(value)}, above the configured upper bound of {_num(limit)}",
                "OJS ML §15.1",
                f"request at most {_num(limit)}, or raise the bound with the "
                f"ojs_ml_max_{attr.removeprefix('ext_ml_')} setting (docs/settings.md)",
            )


def _checksum(m: MLRequirements, b: Bounds) -> Iterator[Violation]:
    if m.ext_ml_model_checksum is None:
        return
    algorithm, _, digest = m.ext_ml_model_checksum.partition(":")
    expected = CHECKSUM_HEX_DIGITS.get(algorithm)
    if expected is None:
        why = _NOT_COMPUTABLE.get(algorithm)
        known = ", ".join(sorted(CHECKSUM_HEX_DIGITS))
        yield _v(
            "ext_ml_model_checksum",
            f"uses algorithm {algorithm!r}, which is not supported ({why}); supported: {known}"
            if why
            else f"uses unknown algorithm {algorithm!r}; supported: {known}",
            'write "algorithm:hexdigest", e.g. "sha256:<64 hex digits>"',
        )
    elif len(digest) != expected:
        yield _v(
            "ext_ml_model_checksum",
            f"has a {len(digest)}-digit {algorithm} digest; {algorithm} has {expected}",
            f'give the full digest, e.g. "{algorithm}:{"0" * expected}"',
        )


def _uris(m: MLRequirements, b: Bounds) -> Iterator[Violation]:
    if m.ext_ml_checkpoint_storage_uri is not None:
        for problem in uris.checkpoint_problems(
            m.ext_ml_checkpoint_storage_uri, b.checkpoint_schemes, b.checkpoint_prefixes
        ):
            yield Violation(
                "ext_ml_checkpoint_storage_uri",
                problem.text,
                problem.section,
                problem.fix
                or "use an allowed scheme, no '..', and a trailing slash, e.g. "
                '"s3://bucket/checkpoints/run-1/"',
            )
    if m.ext_ml_model_registry_uri is not None:
        for problem in uris.uri_problems(m.ext_ml_model_registry_uri, b.model_registry_schemes):
            yield Violation(
                "ext_ml_model_registry_uri",
                problem.text,
                "OJS ML §15.2",
                'use a registry URI without traversal or credentials, e.g. "hf://org/model@main"',
            )


def _model_allow_list(m: MLRequirements, b: Bounds) -> Iterator[Violation]:
    allowed = b.allowed_model_ids
    if allowed is not None and m.ext_ml_model_id is not None and m.ext_ml_model_id not in allowed:
        yield Violation(
            "ext_ml_model_id",
            f"{m.ext_ml_model_id!r} is not in the model allow-list",
            "OJS ML §15.2",
            f"use one of {sorted(allowed)} or add it to ojs_ml_allowed_model_ids",
        )


def _escalation(m: MLRequirements, b: Bounds) -> Iterator[Violation]:
    target = m.ext_ml_escalation_target_class
    if target is None:
        return
    own = m.ext_ml_priority_class or "on-demand"
    if priority_rank(target) <= priority_rank(own):
        higher = [c for c in PRIORITY_CLASSES if priority_rank(c) > priority_rank(own)]
        example = f'"ext_ml_escalation_target_class": "{higher[0]}"' if higher else "remove it"
        yield _v(
            "ext_ml_escalation_target_class",
            f'"{target}" is not a higher priority class than the job\'s own "{own}"',
            f"escalate to a higher class, e.g. {example}",
        )


def _num(value: float | int) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


CHECKS: tuple[Callable[[MLRequirements, Bounds], Iterator[Violation]], ...] = (
    _gpu_count_zero,
    _accelerator_conflicts,
    _tpu_topology,
    _catalogue_contradictions,
    _bounds,
    _checksum,
    _uris,
    _model_allow_list,
    _escalation,
    label_checks,
    sharing.share_checks,
)


def check(m: MLRequirements, b: Bounds) -> list[Violation]:
    """Every cross-field violation of the model under the given bounds."""
    return [v for fn in CHECKS for v in fn(m, b)]


# -- inference ---------------------------------------------------------------------------------


def infer(m: MLRequirements) -> MLRequirements:
    """Apply the defaults and inference rules; idempotent."""
    updates: dict[str, Any] = {}
    _infer_accelerator(m, updates)
    _infer_priority(m, updates)
    _infer_checkpoint(m, updates)
    if m.ojs_ml_gpu_share is False:
        updates["ojs_ml_gpu_share"] = None  # `false` is the default: whole GPUs
    return m.model_copy(update=updates) if updates else m


def _infer_accelerator(m: MLRequirements, out: dict[str, Any]) -> None:
    if wants_gpu(m):
        out["ext_ml_accelerator"] = "gpu"
        count = m.ext_ml_gpu_count if m.ext_ml_gpu_count is not None else 1
        out["ext_ml_gpu_count"] = count
        if count == 1 and m.ext_ml_gpu_interconnect is not None:
            out["ext_ml_gpu_interconnect"] = None
        cc = required_cc(m)
        if cc is not None:
            out["ext_ml_gpu_compute_capability"] = cc
    elif wants_tpu(m):
        out["ext_ml_accelerator"] = "tpu"
        if m.ext_ml_tpu_chip_count is None and m.ext_ml_tpu_topology is not None:
            out["ext_ml_tpu_chip_count"] = topology_chips(m.ext_ml_tpu_topology)


def _infer_priority(m: MLRequirements, out: dict[str, Any]) -> None:
    preemptible = m.ext_ml_preemptible
    if preemptible is None and m.ext_ml_priority_class is not None:
        preemptible = m.ext_ml_priority_class == "spot"
        out["ext_ml_preemptible"] = preemptible
    if preemptible:
        if m.ext_ml_preemption_grace_period_s is None:
            out["ext_ml_preemption_grace_period_s"] = 30
        if m.ext_ml_checkpoint_on_preempt is None:
            out["ext_ml_checkpoint_on_preempt"] = False
    if m.ext_ml_priority_escalation:
        if m.ext_ml_escalation_after_s is None:
            out["ext_ml_escalation_after_s"] = 3600
        own = priority_rank(m.ext_ml_priority_class or "on-demand")
        if m.ext_ml_escalation_target_class is None and own + 1 < len(PRIORITY_CLASSES):
            out["ext_ml_escalation_target_class"] = PRIORITY_CLASSES[own + 1]


def _infer_checkpoint(m: MLRequirements, out: dict[str, Any]) -> None:
    if m.ext_ml_checkpoint_enabled or m.ext_ml_checkpoint_on_preempt:
        if m.ext_ml_checkpoint_interval_s is None and m.ext_ml_checkpoint_enabled:
            out["ext_ml_checkpoint_interval_s"] = 300
        if m.ext_ml_checkpoint_max_count is None:
            out["ext_ml_checkpoint_max_count"] = 3
