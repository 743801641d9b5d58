"""The GPU-share opt-in `ojs_ml_gpu_share` (docs/sharing.md): accepted values, the rules
that tie it to `ext_ml_gpu_memory_gb`, one GPU and no dedicated affinity, and its class."""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.classes import class_id
from celery_ojs_ml.spec.envelope import parse_job, requirements_of, split_attrs
from celery_ojs_ml.spec.resources import MLRequirements


def reqs(**attrs: Any) -> MLRequirements:
    return requirements_of(attrs)[0]


def error(**attrs: Any) -> str:
    with pytest.raises(SpecError) as info:
        requirements_of(attrs)
    return str(info.value)


def test_a_vram_share_is_one_gpu_of_its_memory_and_keeps_the_key_in_canonical_form() -> None:
    r = reqs(ojs_ml_gpu_share=True, ext_ml_gpu_memory_gb=10)
    assert r.flat() == {
        "ext_ml_accelerator": "gpu",
        "ext_ml_gpu_count": 1,
        "ext_ml_gpu_memory_gb": 10.0,
        "ojs_ml_gpu_share": True,
    }


def test_a_fraction_share_needs_no_memory_and_implies_a_gpu() -> None:
    assert reqs(ojs_ml_gpu_share=0.25).flat()["ext_ml_gpu_count"] == 1


def test_false_means_whole_gpus_and_is_the_same_class_as_no_key() -> None:
    off = reqs(ojs_ml_gpu_share=False, ext_ml_gpu_count=1)
    assert off.ojs_ml_gpu_share is None
    assert class_id(off) == class_id(reqs(ext_ml_gpu_count=1))


def test_share_jobs_are_a_class_of_their_own() -> None:
    whole = reqs(ext_ml_gpu_count=1, ext_ml_gpu_memory_gb=10)
    shared = reqs(ojs_ml_gpu_share=True, ext_ml_gpu_memory_gb=10)
    assert len({class_id(whole), class_id(shared), class_id(reqs(ojs_ml_gpu_share=0.5))}) == 3


def test_a_vram_share_without_gpu_memory_is_an_error_naming_both_attributes_and_the_fix() -> None:
    assert error(ojs_ml_gpu_share=True) == (
        "ojs_ml_gpu_share is true (share one GPU by VRAM) but ext_ml_gpu_memory_gb is not set "
        "(celery-ojs-ml GPU sharing, docs/sharing.md); say how much VRAM the job needs, e.g. "
        '"ojs_ml_gpu_share": true, "ext_ml_gpu_memory_gb": 10, or share a fraction of a GPU, '
        'e.g. "ojs_ml_gpu_share": 0.25'
    )


def test_a_share_of_more_than_one_gpu_is_an_error_naming_the_count() -> None:
    assert error(ojs_ml_gpu_share=0.5, ext_ml_gpu_count=2) == (
        "ext_ml_gpu_count is 2 but ojs_ml_gpu_share is set; a GPU share is one device "
        '(celery-ojs-ml GPU sharing, docs/sharing.md); set "ext_ml_gpu_count": 1 (or leave it '
        "out), or remove ojs_ml_gpu_share to take whole GPUs"
    )


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.2, "yes", [0.5]])
def test_a_share_that_is_neither_true_nor_a_fraction_is_an_error_with_an_example(bad: Any) -> None:
    message = error(ojs_ml_gpu_share=bad)
    assert message.startswith("ojs_ml_gpu_share is invalid: value error, must be true")
    assert '"ojs_ml_gpu_share": 0.25' in message


def test_a_dedicated_job_never_shares() -> None:
    message = error(ojs_ml_gpu_share=0.5, ext_mlx_scheduling_gpu_affinity="dedicated")
    assert message.startswith(
        "ojs_ml_gpu_share is set but ext_mlx_scheduling_gpu_affinity is dedicated"
    )


def test_a_share_on_a_cpu_accelerator_is_an_error() -> None:
    assert error(ojs_ml_gpu_share=0.5, ext_ml_accelerator="cpu").startswith(
        'ext_ml_accelerator is "cpu" but GPU attributes are set'
    )


def test_the_key_travels_with_the_requirements_of_an_ojs_document() -> None:
    ml, mlx = split_attrs({"ojs_ml_gpu_share": 0.5, "ext_mlx_model_size": 1, "other": 2})
    assert ml == {"ojs_ml_gpu_share": 0.5} and mlx == {"ext_mlx_model_size": 1}
    job = parse_job({"type": "ml.infer", "ojs_ml_gpu_share": True, "ext_ml_gpu_memory_gb": 8})
    assert job.requirements.ojs_ml_gpu_share is True
