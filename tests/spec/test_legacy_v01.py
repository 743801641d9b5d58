"""OJS ML v0.1 `meta.*` form: mapped onto the same canonical model as v0.3."""

from __future__ import annotations

import pytest

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.envelope import parse_job


def test_the_v0_1_resource_schema_maps_to_the_same_requirements_as_v0_3() -> None:
    """v0.1 §2.1-§2.2 and v0.3 §3 describe the same request; both normalise alike."""
    old = parse_job(
        {
            "type": "ml.train",
            "meta": {
                "resources": {
                    "gpu": {"count": 2, "type": "nvidia-a100", "memory_gb": 40},
                    "cpu": {"cores": 8},
                    "memory_gb": 64,
                    "storage_gb": 200,
                }
            },
        }
    )
    new = parse_job(
        {
            "type": "ml.train",
            "ext_ml_gpu_count": 2,
            "ext_ml_gpu_type": "nvidia-a100",
            "ext_ml_gpu_memory_gb": 40,
            "ext_ml_cpu_cores": 8,
            "ext_ml_memory_gb": 64,
            "ext_ml_storage_gb": 200,
        }
    )
    assert old.requirements == new.requirements


def test_affinity_checkpoint_and_preemption_blocks_map_to_v0_3_attributes() -> None:
    job = parse_job(
        {
            "type": "ml.train",
            "meta": {
                "affinity": {
                    "required": [{"key": "region", "operator": "In", "values": ["us-east-1"]}]
                },
                "checkpoint": {
                    "enabled": True,
                    "interval_s": 120,
                    "storage_uri": "s3://b/c/",
                    "max_checkpoints": 5,
                },
                "preemption": {
                    "preemptible": True,
                    "grace_period_s": 60,
                    "checkpoint_on_preempt": True,
                },
            },
        }
    )
    flat = job.canonical()
    assert flat["ext_ml_affinity"]["required"][0]["key"] == "region"
    assert (flat["ext_ml_checkpoint_interval_s"], flat["ext_ml_checkpoint_max_count"]) == (120, 5)
    assert flat["ext_ml_checkpoint_storage_uri"] == "s3://b/c/"
    assert (flat["ext_ml_preemptible"], flat["ext_ml_preemption_grace_period_s"]) == (True, 60)
    assert flat["ext_ml_checkpoint_on_preempt"] is True


def test_last_checkpoint_in_meta_is_carried_on_the_job_section_4_4() -> None:
    ckpt = {"epoch": 42, "loss": 0.0234, "storage_key": "s3://b/ckpt/job-123/epoch-42.pt"}
    job = parse_job({"type": "ml.train", "meta": {"last_checkpoint": ckpt}})
    assert job.last_checkpoint == ckpt


def test_a_gpu_block_without_a_count_means_one_gpu_not_zero() -> None:
    job = parse_job({"type": "t", "meta": {"resources": {"gpu": {"type": "nvidia-t4"}}}})
    assert job.requirements.ext_ml_gpu_count == 1


def test_errors_in_the_v0_1_form_name_the_meta_path() -> None:
    with pytest.raises(SpecError) as info:
        parse_job({"type": "t", "meta": {"resources": {"gpu": {"count": "two"}}}})
    assert info.value.paths == ["meta.resources.gpu.count"]
    assert str(info.value).startswith(
        "meta.resources.gpu.count is invalid: input should be a valid integer (OJS ML §3.2)"
    )


def test_a_v0_1_block_that_is_not_an_object_is_rejected() -> None:
    with pytest.raises(SpecError, match=r"meta.resources must be an object \(OJS ML v0.1 §2.2\)"):
        parse_job({"type": "t", "meta": {"resources": ["gpu"]}})


def test_both_forms_may_be_combined_but_must_not_disagree() -> None:
    ok = parse_job(
        {"type": "t", "ext_ml_gpu_count": 2, "meta": {"resources": {"gpu": {"count": 2}}}}
    )
    assert ok.requirements.ext_ml_gpu_count == 2
    with pytest.raises(SpecError, match=r"ext_ml_gpu_count is 4 but the v0\.1 meta form says 2"):
        parse_job(
            {"type": "t", "ext_ml_gpu_count": 4, "meta": {"resources": {"gpu": {"count": 2}}}}
        )


def test_the_v0_1_gpu_count_zero_with_a_type_is_rejected_like_v0_3() -> None:
    with pytest.raises(SpecError) as info:
        parse_job({"type": "t", "meta": {"resources": {"gpu": {"count": 0, "type": "nvidia-t4"}}}})
    assert info.value.paths == ["meta.resources.gpu.count"]
