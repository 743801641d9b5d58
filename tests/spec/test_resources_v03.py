"""OJS ML Resources v0.3: every validation MUST, the SHOULDs we follow, and the error text."""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.catalogue import PRIORITY_CLASSES, priority_rank
from celery_ojs_ml.spec.envelope import ParseOptions, parse_job
from celery_ojs_ml.spec.normalize import Bounds, normalize
from celery_ojs_ml.spec.policy import QueueLimits, QueuePolicy
from tests.helpers import flat, rejects

# -- §3 types, enums and ranges -----------------------------------------------------------------

BAD_VALUES = [
    ("ext_ml_accelerator", "GPU", "must be one of 'gpu', 'tpu', 'fpga' or 'cpu'"),
    ("ext_ml_gpu_count", "2", "is invalid: input should be a valid integer"),
    ("ext_ml_gpu_count", True, "is invalid: input should be a valid integer"),
    ("ext_ml_gpu_count", -1, "is invalid: input should be greater than or equal to 0"),
    ("ext_ml_gpu_memory_gb", "80", "is invalid: input should be a valid number"),
    ("ext_ml_gpu_memory_gb", 0, "is invalid: input should be greater than 0"),
    ("ext_ml_gpu_compute_capability", "8", "has an invalid format"),
    ("ext_ml_gpu_compute_capability", 8.0, "is invalid: input should be a valid string"),
    ("ext_ml_gpu_interconnect", "infiniband", "must be one of 'nvlink', 'pcie' or 'any'"),
    ("ext_ml_gpu_type", "A100", "has an invalid format"),
    ("ext_ml_tpu_type", "v3", "must be one of 'v4', 'v5e', 'v5p' or 'v6e'"),
    ("ext_ml_tpu_topology", "2by4", "has an invalid format"),
    ("ext_ml_cpu_cores", 0, "is invalid: input should be greater than or equal to 1"),
    ("ext_ml_memory_gb", -5, "is invalid: input should be greater than or equal to 0"),
    ("ext_ml_model_provider", "acme", "must be one of"),
    ("ext_ml_model_format", "pickle", "must be one of"),
    ("ext_ml_model_registry", "dockerhub", "must be one of"),
    ("ext_ml_runtime", "jax", "must be one of"),
    ("ext_ml_precision", "fp64", "must be one of"),
    ("ext_ml_distributed_strategy", "horovod", "must be one of"),
    ("ext_ml_priority_class", "premium", "must be one of 'spot', 'on-demand' or 'reserved'"),
    ("ext_ml_preemptible", "yes", "is invalid: input should be a valid boolean"),
    ("ext_ml_timeout_seconds", 1.5, "is invalid: input should be a valid integer"),
    ("ext_ml_checkpoint_max_count", 0, "is invalid: input should be greater than or equal to 1"),
]


@pytest.mark.parametrize(
    ("attr", "value", "problem"),
    BAD_VALUES,
    ids=[
        f"{a} = {v!r} is rejected by type, enum or range (OJS ML §3-§9)" for a, v, _ in BAD_VALUES
    ],
)
def test_attributes_are_validated_against_their_type_enum_and_range(
    attr: str, value: Any, problem: str
) -> None:
    """§3: backends MUST validate these attributes against the constraints of the section."""
    error = rejects({attr: value})
    assert error.paths == [attr]
    assert problem in str(error)
    assert "OJS ML §" in str(error)
    assert "e.g." in str(error) or "set " in str(error)


def test_a_type_error_names_the_attribute_the_section_and_a_correct_example() -> None:
    assert str(rejects({"ext_ml_gpu_count": "2"})) == (
        "ext_ml_gpu_count is invalid: input should be a valid integer (OJS ML §3.2); "
        'set ext_ml_gpu_count to a valid value, e.g. "ext_ml_gpu_count": 1'
    )


def test_every_violation_is_reported_at_once() -> None:
    error = rejects({"ext_ml_gpu_count": "x", "ext_ml_precision": "fp64", "ext_ml_cpu_cores": 0})
    assert sorted(error.paths) == ["ext_ml_cpu_cores", "ext_ml_gpu_count", "ext_ml_precision"]


# -- §3.1 accelerator inference -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("attrs", "accelerator"),
    [
        ({"gpu_count": 2}, "gpu"),
        ({"gpu_type": "nvidia-l4"}, "gpu"),
        ({"gpu_memory_gb": 24}, "gpu"),
        ({"tpu_type": "v5e"}, "tpu"),
        ({"tpu_topology": "2x2"}, "tpu"),
    ],
    ids=[
        "a GPU count implies the gpu accelerator (§3.1)",
        "a GPU type implies the gpu accelerator (§3.1)",
        "a VRAM minimum implies the gpu accelerator (§3.1)",
        "a TPU type implies the tpu accelerator (§3.1)",
        "a TPU topology implies the tpu accelerator (§3.1)",
    ],
)
def test_the_accelerator_is_inferred_from_gpu_or_tpu_fields(
    attrs: dict[str, Any], accelerator: str
) -> None:
    assert flat(**attrs)["ext_ml_accelerator"] == accelerator


def test_a_cpu_job_with_gpu_attributes_is_rejected_as_contradictory() -> None:
    error = rejects({"ext_ml_accelerator": "cpu", "ext_ml_gpu_type": "nvidia-a100"})
    assert str(error).startswith(
        'ext_ml_accelerator is "cpu" but GPU attributes are set (OJS ML §3.1)'
    )


def test_a_job_asking_for_both_a_gpu_and_a_tpu_is_rejected() -> None:
    error = rejects({"ext_ml_gpu_type": "nvidia-a100", "ext_ml_tpu_type": "v5e"})
    assert "both GPU and TPU" in str(error)


# -- §3.2 GPUs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "other",
    ["ext_ml_gpu_type", "ext_ml_gpu_memory_gb", "ext_ml_gpu_compute_capability"],
)
def test_gpu_count_zero_with_another_gpu_attribute_is_rejected_section_3_2(other: str) -> None:
    """§3.2: a backend MUST reject ext_ml_gpu_count 0 alongside other GPU attributes."""
    value = {
        "ext_ml_gpu_type": "nvidia-a100",
        "ext_ml_gpu_memory_gb": 40,
        "ext_ml_gpu_compute_capability": "8.0",
    }[other]
    error = rejects({"ext_ml_gpu_count": 0, other: value})
    assert str(error) == (
        f"ext_ml_gpu_count is 0 but {other} is set (OJS ML §3.2); "
        f'set ext_ml_gpu_count >= 1, e.g. "ext_ml_gpu_count": 1, or remove {other}'
    )


def test_gpu_count_zero_alone_is_a_valid_cpu_job() -> None:
    assert flat(gpu_count=0) == {"ext_ml_gpu_count": 0}


def test_the_gpu_count_defaults_to_one_when_any_gpu_attribute_is_set() -> None:
    """§3.2: default 1 when any GPU attribute is set."""
    assert flat(gpu_type="nvidia-t4")["ext_ml_gpu_count"] == 1
    assert flat(accelerator="gpu")["ext_ml_gpu_count"] == 1


def test_the_interconnect_is_ignored_for_a_single_gpu() -> None:
    """§3.2: when ext_ml_gpu_count is 1, the interconnect SHOULD be ignored."""
    assert "ext_ml_gpu_interconnect" not in flat(gpu_count=1, gpu_interconnect="nvlink")
    assert flat(gpu_count=2, gpu_interconnect="nvlink")["ext_ml_gpu_interconnect"] == "nvlink"


@pytest.mark.parametrize(
    ("precision", "cc"),
    [
        ("fp32", "7.0"),
        ("fp16", "7.0"),
        ("bf16", "8.0"),
        ("fp8", "8.9"),
        ("int8", "7.5"),
        ("int4", "7.5"),
    ],
)
def test_the_minimum_compute_capability_is_inferred_from_precision_section_6(
    precision: str, cc: str
) -> None:
    """§6 (and §3.2: a bf16 job MUST require at least 8.0)."""
    assert flat(gpu_count=1, precision=precision)["ext_ml_gpu_compute_capability"] == cc


def test_a_declared_compute_capability_wins_over_the_precision() -> None:
    assert (
        flat(gpu_count=1, precision="bf16", gpu_compute_capability="9.0")[
            "ext_ml_gpu_compute_capability"
        ]
        == "9.0"
    )


def test_precision_on_a_cpu_job_implies_no_compute_capability() -> None:
    assert "ext_ml_gpu_compute_capability" not in flat(accelerator="cpu", precision="bf16")


def test_a_gpu_type_that_cannot_reach_the_compute_capability_is_rejected() -> None:
    error = rejects({"ext_ml_gpu_type": "nvidia-t4", "ext_ml_gpu_compute_capability": "8.0"})
    assert "8.0 exceeds nvidia-t4's compute capability 7.5" in str(error)


def test_a_vram_request_above_the_catalogue_size_of_the_gpu_type_is_rejected() -> None:
    error = rejects({"ext_ml_gpu_type": "nvidia-l4", "ext_ml_gpu_memory_gb": 80})
    assert str(error).startswith(
        "ext_ml_gpu_memory_gb 80 exceeds nvidia-l4's largest VRAM of 24 GB"
    )


def test_unknown_gpu_types_following_vendor_model_are_accepted() -> None:
    """§3.2: implementations MAY accept identifiers following {vendor}-{model}."""
    assert flat(gpu_type="intel-gaudi3")["ext_ml_gpu_type"] == "intel-gaudi3"


# -- §3.3 TPUs ----------------------------------------------------------------------------------


def test_a_tpu_topology_must_agree_with_the_chip_count() -> None:
    error = rejects({"ext_ml_tpu_topology": "4x4", "ext_ml_tpu_chip_count": 8})
    assert str(error) == (
        "ext_ml_tpu_chip_count is 8 but ext_ml_tpu_topology 4x4 has 16 chips (OJS ML §3.3); "
        'make them agree, e.g. "ext_ml_tpu_topology": "4x4", "ext_ml_tpu_chip_count": 16'
    )


def test_a_three_dimensional_topology_is_accepted_and_infers_its_chip_count() -> None:
    assert flat(tpu_type="v5p", tpu_topology="2x2x4")["ext_ml_tpu_chip_count"] == 16


# -- §4 model identity --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("checksum", "problem"),
    [
        ("sha256:abc", "has a 3-digit sha256 digest; sha256 has 64"),
        ("crc32:deadbeef", "uses unknown algorithm 'crc32'"),
        ("sha256:" + "g" * 64, "has an invalid format"),
        ("e3b0c442", "has an invalid format"),
    ],
    ids=[
        "a short sha256 digest",
        "an unknown algorithm",
        "a non-hex digest",
        "a missing algorithm",
    ],
)
def test_a_model_checksum_must_be_algorithm_colon_full_hexdigest(
    checksum: str, problem: str
) -> None:
    error = rejects({"ext_ml_model_checksum": checksum})
    assert problem in str(error)


def test_a_valid_sha256_checksum_is_accepted() -> None:
    digest = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert flat(model_checksum=f"sha256:{digest}")["ext_ml_model_checksum"].endswith(digest)


def test_the_truncated_checksum_in_the_section_5_2_snippet_is_rejected() -> None:
    """§5.2 shows `sha256:e3b0c44298fc...`, an illustration with an elided digest; we reject it."""
    assert "12-digit sha256 digest" in str(
        rejects({"ext_ml_model_checksum": "sha256:e3b0c44298fc"})
    )


# -- §7 affinity --------------------------------------------------------------------------------


def _rule(**kw: Any) -> dict[str, Any]:
    return {"ext_ml_affinity": {"required": [kw]}}


@pytest.mark.parametrize(
    ("rule", "path", "problem"),
    [
        ({"key": "gpu_type", "operator": "In"}, "values", "is required for operator In"),
        (
            {"key": "zone", "operator": "Exists", "values": ["a"]},
            "values",
            "must be empty for operator Exists",
        ),
        (
            {"key": "gpu_count", "operator": "Gt", "values": ["many"]},
            "values[0]",
            "is 'many' but Gt needs a number",
        ),
        (
            {"key": "compute_capability", "operator": "Gte", "values": ["ampere"]},
            "values[0]",
            "is 'ampere' but Gte needs a major.minor version",
        ),
        (
            {"key": "gpu_count", "operator": "Lt", "values": ["1", "2"]},
            "values",
            "must hold exactly one value for Lt",
        ),
        ({"key": "gpu_count", "operator": "Approx", "values": ["1"]}, "operator", "must be one of"),
        (
            {"key": "gpu_type", "operator": "In", "values": ["x"], "weight": 5},
            "weight",
            "only applies to preferred rules",
        ),
    ],
    ids=[
        "In without values is rejected (§7.2)",
        "Exists with values is rejected (§7.2)",
        "Gt with a non-number is rejected (§7.2)",
        "Gte on compute_capability needs a version (§7.2)",
        "a numeric operator takes exactly one value (§7.2)",
        "an unknown operator is rejected (§7.2)",
        "a weight on a required rule is rejected (§7.2)",
    ],
)
def test_affinity_rules_are_checked(rule: dict[str, Any], path: str, problem: str) -> None:
    error = rejects(_rule(**rule))
    assert error.paths == [f"ext_ml_affinity.required[0].{path}"]
    assert problem in str(error)


@pytest.mark.parametrize("weight", [-1, 101])
def test_a_preferred_weight_must_be_between_0_and_100(weight: int) -> None:
    attrs = {
        "ext_ml_affinity": {
            "preferred": [{"key": "region", "operator": "In", "values": ["eu"], "weight": weight}]
        }
    }
    assert rejects(attrs).paths == ["ext_ml_affinity.preferred[0].weight"]


def test_all_eight_operators_are_accepted() -> None:
    rules = [
        {"key": "gpu_type", "operator": "In", "values": ["nvidia-a100"]},
        {"key": "gpu_type", "operator": "NotIn", "values": ["nvidia-t4"]},
        {"key": "zone", "operator": "Exists"},
        {"key": "spot", "operator": "DoesNotExist"},
        {"key": "gpu_count", "operator": "Gt", "values": ["1"]},
        {"key": "compute_capability", "operator": "Gte", "values": ["10.0"]},
        {"key": "gpu_memory_gb", "operator": "Lt", "values": ["100.5"]},
        {"key": "cpu_cores", "operator": "Lte", "values": ["96"]},
    ]
    out = normalize({"ext_ml_affinity": {"required": rules}}).flat()
    assert [r["operator"] for r in out["ext_ml_affinity"]["required"]] == [
        "In",
        "NotIn",
        "Exists",
        "DoesNotExist",
        "Gt",
        "Gte",
        "Lt",
        "Lte",
    ]


# -- §8 priority --------------------------------------------------------------------------------


def test_priority_classes_are_ordered_reserved_over_on_demand_over_spot_section_8_1() -> None:
    """§8.1: a backend that supports preemption MUST order reserved > on-demand > spot."""
    assert sorted(PRIORITY_CLASSES, key=priority_rank, reverse=True) == [
        "reserved",
        "on-demand",
        "spot",
    ]


@pytest.mark.parametrize(
    ("klass", "preemptible"), [("spot", True), ("on-demand", False), ("reserved", False)]
)
def test_preemptible_defaults_from_the_priority_class_section_8_2(
    klass: str, preemptible: bool
) -> None:
    assert flat(priority_class=klass)["ext_ml_preemptible"] is preemptible


def test_a_preemptible_job_gets_the_30_second_grace_period_by_default() -> None:
    out = flat(priority_class="spot")
    assert out["ext_ml_preemption_grace_period_s"] == 30
    assert out["ext_ml_checkpoint_on_preempt"] is False


def test_an_explicit_preemptible_value_wins_over_the_class_default() -> None:
    assert flat(priority_class="spot", preemptible=False)["ext_ml_preemptible"] is False


def test_the_escalation_target_must_be_a_higher_class_section_8_4() -> None:
    error = rejects(
        {"ext_ml_priority_class": "on-demand", "ext_ml_escalation_target_class": "spot"}
    )
    assert str(error) == (
        'ext_ml_escalation_target_class "spot" is not a higher priority class than the job\'s '
        'own "on-demand" (OJS ML §8.4); escalate to a higher class, e.g. '
        '"ext_ml_escalation_target_class": "reserved"'
    )


def test_escalation_defaults_to_an_hour_and_the_next_class_up() -> None:
    out = flat(priority_class="spot", priority_escalation=True)
    assert out["ext_ml_escalation_after_s"] == 3600
    assert out["ext_ml_escalation_target_class"] == "on-demand"


# -- §9 checkpoints -----------------------------------------------------------------------------


def test_checkpoint_defaults_are_300_seconds_and_3_checkpoints_section_9_1() -> None:
    out = flat(checkpoint_enabled=True, checkpoint_storage_uri="s3://b/ckpt/")
    assert out["ext_ml_checkpoint_interval_s"] == 300
    assert out["ext_ml_checkpoint_max_count"] == 3


@pytest.mark.parametrize(
    ("uri", "problem"),
    [
        ("s3://bucket/ckpt", "must end with '/' to name a directory prefix (OJS ML §9.4)"),
        ("http://example.com/ckpt/", "uses 'http'; allowed schemes are az, file, gs, s3"),
        ("s3://bucket/../other/", "contains a '..' path segment (path traversal) (OJS ML §15.3)"),
        ("s3://bucket/%2e%2e/other/", "path traversal"),
        ("file://remote-host/ckpt/", "is a file URI with a remote host"),
        ("s3://key:secret@bucket/ckpt/", "embeds credentials"),
        ("/mnt/ckpt/", "uses 'no scheme'"),
    ],
    ids=[
        "a URI without a trailing slash is rejected (§9.4 MUST)",
        "an http URI is not an allowed scheme (§9.4)",
        "a traversal segment is rejected (§15.3 MUST)",
        "a percent-encoded traversal is rejected (§15.3 MUST)",
        "a file URI on a remote host is rejected (§15.3)",
        "credentials in the URI are rejected (§15.3)",
        "a bare path without a scheme is rejected (§9.4)",
    ],
)
def test_checkpoint_storage_uris_are_validated(uri: str, problem: str) -> None:
    error = rejects({"ext_ml_checkpoint_storage_uri": uri})
    assert error.paths == ["ext_ml_checkpoint_storage_uri"]
    assert problem in str(error)


def test_checkpoint_uris_are_checked_against_the_prefix_allow_list_section_15_3() -> None:
    bounds = Bounds(checkpoint_prefixes=("s3://team-a/",))
    normalize({"ext_ml_checkpoint_storage_uri": "s3://team-a/run/"}, bounds)
    with pytest.raises(SpecError, match=r"is outside the allowed prefixes \['s3://team-a/'\]"):
        normalize({"ext_ml_checkpoint_storage_uri": "s3://team-b/run/"}, bounds)


# -- §15 security -------------------------------------------------------------------------------


def test_a_request_for_1000_gpus_is_rejected_by_the_default_bounds_section_15_1() -> None:
    """§15.1: a malicious client requesting 1000 GPUs MUST be rejected."""
    assert str(rejects({"ext_ml_gpu_count": 1000})) == (
        "ext_ml_gpu_count is 1000, above the configured upper bound of 64 (OJS ML §15.1); "
        "request at most 64, or raise the bound with the ojs_ml_max_gpu_count setting "
        "(docs/settings.md)"
    )


@pytest.mark.parametrize(
    ("attr", "value"),
    [
        ("ext_ml_gpu_memory_gb", 4096),
        ("ext_ml_cpu_cores", 100_000),
        ("ext_ml_memory_gb", 10**6),
        ("ext_ml_tpu_chip_count", 10**5),
        ("ext_ml_timeout_seconds", 10**9),
        ("ext_ml_shm_size_gb", 10**5),
        ("ext_ml_storage_gb", 10**7),
    ],
)
def test_every_resource_has_a_configurable_upper_bound_section_15_1(attr: str, value: int) -> None:
    assert "above the configured upper bound" in str(rejects({attr: value}))


def test_bounds_are_configurable() -> None:
    assert (
        normalize({"ext_ml_gpu_count": 128}, Bounds(max_gpu_count=256)).flat()["ext_ml_gpu_count"]
        == 128
    )


@pytest.mark.parametrize(
    ("uri", "problem"),
    [
        ("hf://org/../../etc/passwd", "path traversal"),
        ("mlflow://169.254.169.254/latest/meta-data/", "internal address '169.254.169.254' (SSRF)"),
        ("mlflow://127.0.0.1/model/1", "internal address"),
        ("mlflow://10.0.0.5/model/1", "internal address"),
        ("http://registry.example/model", "uses 'http'"),
    ],
    ids=[
        "traversal",
        "cloud metadata SSRF",
        "loopback SSRF",
        "private network SSRF",
        "a scheme outside the allow-list",
    ],
)
def test_model_registry_uris_are_validated_against_traversal_and_ssrf_section_15_2(
    uri: str, problem: str
) -> None:
    error = rejects({"ext_ml_model_registry_uri": uri})
    assert problem in str(error)
    assert "(OJS ML §15.2)" in str(error)


def test_a_model_id_outside_a_configured_allow_list_is_rejected_section_15_2() -> None:
    bounds = Bounds(allowed_model_ids=frozenset({"llama-3.1-8b"}))
    with pytest.raises(SpecError, match="'evil-model' is not in the model allow-list"):
        normalize({"ext_ml_model_id": "evil-model"}, bounds)


@pytest.mark.parametrize(
    "selector",
    [{"region": "us east"}, {"region": "a;rm -rf"}, {"bad key!": "x"}, {"region": 5}],
    ids=[
        "a value with a space",
        "a value with shell metacharacters",
        "a key with punctuation",
        "a non-string value",
    ],
)
def test_node_selector_values_are_sanitised_section_15_4(selector: dict[str, Any]) -> None:
    """§15.4: node selector values MUST be sanitized."""
    assert rejects({"ext_ml_node_selector": selector}).paths[0].startswith("ext_ml_node_selector")


def test_administrative_labels_cannot_be_selected_by_producers_section_15_4() -> None:
    """§15.4: a client MUST NOT be able to inject labels that bypass scheduling constraints."""
    error = rejects({"ext_ml_node_selector": {"security_zone": "pci"}})
    assert str(error).startswith(
        "ext_ml_node_selector.security_zone uses the administrative label 'security_zone'"
    )
    error = rejects(
        {"ext_ml_affinity": {"required": [{"key": "cost_center", "operator": "Exists"}]}}
    )
    assert error.paths == ["ext_ml_affinity.required[0].key"]


# -- §10 queue defaults and limits --------------------------------------------------------------

POLICY = QueuePolicy(
    ml_defaults={
        "ext_ml_accelerator": "gpu",
        "ext_ml_gpu_count": 1,
        "ext_ml_timeout_seconds": 60,
        "ext_ml_priority_class": "on-demand",
    },
    ml_limits=QueueLimits(
        max_gpu_count=4,
        max_gpu_memory_gb=80,
        max_timeout_seconds=3600,
        allowed_gpu_types=("nvidia-a100", "nvidia-l4"),
        allowed_priority_classes=("on-demand", "reserved"),
        max_concurrent_gpu_jobs=1,
        max_total_gpus=1,
    ),
)
OPTIONS = ParseOptions(policies={"gpu-inference": POLICY})


def test_queue_defaults_fill_every_unset_attribute_section_10_1() -> None:
    """§10.1: unset ext_ml_* attributes MUST be filled with the queue's default value."""
    job = parse_job({"type": "t", "queue": "gpu-inference", "ext_ml_timeout_seconds": 5}, OPTIONS)
    assert job.requirements.ext_ml_timeout_seconds == 5
    assert job.requirements.ext_ml_gpu_count == 1
    assert job.requirements.ext_ml_priority_class == "on-demand"


@pytest.mark.parametrize(
    ("attrs", "path"),
    [
        ({"ext_ml_gpu_count": 8}, "ext_ml_gpu_count"),
        ({"ext_ml_gpu_type": "nvidia-h100"}, "ext_ml_gpu_type"),
        ({"ext_ml_priority_class": "spot"}, "ext_ml_priority_class"),
        ({"ext_ml_timeout_seconds": 7200}, "ext_ml_timeout_seconds"),
    ],
    ids=["too many GPUs", "a GPU type not allowed", "a class not allowed", "too long a timeout"],
)
def test_jobs_exceeding_queue_limits_are_rejected_section_10_2(
    attrs: dict[str, Any], path: str
) -> None:
    """§10.2: a backend MUST reject jobs whose attributes exceed the queue's limits."""
    with pytest.raises(SpecError) as info:
        parse_job({"type": "t", "queue": "gpu-inference", **attrs}, OPTIONS)
    assert info.value.paths == [path]
    assert "(OJS ML §10.2)" in str(info.value)


def test_queue_budgets_never_reject_a_job_section_10_3() -> None:
    """§10.3: budget-exceeded jobs MUST be queued, not rejected (budget checks are runtime)."""
    job = parse_job({"type": "t", "queue": "gpu-inference", "ext_ml_gpu_count": 2}, OPTIONS)
    assert job.requirements.ext_ml_gpu_count == 2


# -- forward compatibility ----------------------------------------------------------------------


def test_unknown_ext_ml_keys_are_kept_and_warned_about() -> None:
    result = normalize({"ext_ml_gpu_count": 1, "ext_ml_quantum_qubits": 5})
    assert result.flat()["ext_ml_quantum_qubits"] == 5
    assert result.warnings == [
        "ext_ml_quantum_qubits is not an OJS ML v0.3 attribute; kept as is "
        "(OJS ML §1.2 forward compatibility)"
    ]
