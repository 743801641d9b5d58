"""Property-based: arbitrary envelopes never crash the validator; normalising is idempotent."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.envelope import parse_job
from celery_ojs_ml.spec.resources import KNOWN_KEYS

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
GOOD = {
    "ext_ml_accelerator": st.sampled_from(["gpu", "tpu", "cpu", "fpga"]),
    "ext_ml_gpu_type": st.sampled_from(["nvidia-a100", "nvidia-h100", "nvidia-t4", "amd-mi300x"]),
    "ext_ml_gpu_count": st.integers(0, 80),
    "ext_ml_gpu_memory_gb": st.sampled_from([8, 16, 24, 40, 80, 200]),
    "ext_ml_gpu_compute_capability": st.sampled_from(["7.0", "8.0", "8.9", "9.0", "10.0"]),
    "ext_ml_gpu_interconnect": st.sampled_from(["nvlink", "pcie", "any"]),
    "ext_ml_tpu_type": st.sampled_from(["v4", "v5e"]),
    "ext_ml_tpu_topology": st.sampled_from(["2x2", "2x4", "4x4"]),
    "ext_ml_tpu_chip_count": st.integers(1, 32),
    "ext_ml_cpu_cores": st.integers(0, 2000),
    "ext_ml_memory_gb": st.floats(0, 20000),
    "ext_ml_precision": st.sampled_from(["fp32", "fp16", "bf16", "fp8", "int8", "int4"]),
    "ext_ml_priority_class": st.sampled_from(["spot", "on-demand", "reserved"]),
    "ext_ml_preemptible": st.booleans(),
    "ext_ml_priority_escalation": st.booleans(),
    "ext_ml_escalation_target_class": st.sampled_from(["spot", "on-demand", "reserved"]),
    "ext_ml_checkpoint_enabled": st.booleans(),
    "ext_ml_checkpoint_storage_uri": st.sampled_from(["s3://b/c/", "s3://b/c", "gs://b/../x/"]),
    "ext_ml_node_selector": st.dictionaries(
        st.sampled_from(["region", "zone", "cost_center"]),
        st.sampled_from(["us-east-1", "a b"]),
        max_size=2,
    ),
    "ext_ml_model_id": st.text(max_size=5),
}
KEYS = st.sampled_from([*sorted(KNOWN_KEYS), "ext_ml_future_thing", "meta", "type"])


def _check(doc: dict[str, Any]) -> None:
    try:
        job = parse_job(doc)
    except SpecError as exc:
        assert exc.violations, "a SpecError must name at least one attribute"
        assert all(v.path and v.section and v.fix for v in exc.violations)
        return
    flat = job.canonical()
    again = parse_job({"type": "t", **flat}).canonical()
    assert again == flat


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, JSON, max_size=6))
def test_arbitrary_values_never_crash_the_validator(doc: dict[str, Any]) -> None:
    _check({"type": "t", **doc})


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({}, optional=GOOD))
def test_plausible_envelopes_validate_or_fail_cleanly_and_normalise_idempotently(
    doc: dict[str, Any],
) -> None:
    _check({"type": "t", **doc})


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_any_json_document_as_an_envelope_never_crashes(doc: Any) -> None:
    try:
        parse_job(doc)
    except SpecError as exc:
        assert exc.violations
