"""Requirement classes: only hard constraints split queues."""

from __future__ import annotations

from typing import Any

from celery_ojs_ml.spec.classes import band, class_id, has_hard_constraints, queue_name
from celery_ojs_ml.spec.normalize import normalize


def _req(**attrs: Any) -> Any:
    return normalize({f"ext_ml_{k}": v for k, v in attrs.items()}).requirements


def test_jobs_with_the_same_hard_constraints_share_a_class_whatever_their_soft_ones() -> None:
    a = _req(
        gpu_type="nvidia-a100",
        gpu_count=2,
        model_id="m1",
        timeout_seconds=60,
        affinity={"preferred": [{"key": "region", "operator": "In", "values": ["eu"]}]},
    )
    b = _req(gpu_count=2, gpu_type="nvidia-a100", model_id="m2", max_tokens=512)
    assert class_id(a) == class_id(b)


def test_a_different_runtime_or_model_format_is_a_different_class() -> None:
    """OJS ML §6 `ext_ml_runtime` and §4 `ext_ml_model_format` are hard constraints."""
    plain = class_id(_req(gpu_count=1))
    classes = {class_id(_req(gpu_count=1, runtime=r)) for r in ("vllm", "pytorch")}
    formats = {class_id(_req(gpu_count=1, model_format=f)) for f in ("gguf", "safetensors")}
    assert len({plain, *classes, *formats}) == 5
    assert has_hard_constraints(_req(runtime="onnx"))


def test_a_different_vram_minimum_is_a_different_class() -> None:
    assert class_id(_req(gpu_count=1, gpu_memory_gb=40)) != class_id(
        _req(gpu_count=1, gpu_memory_gb=80)
    )


def test_the_order_of_affinity_values_does_not_change_the_class() -> None:
    r1 = _req(affinity={"required": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]})
    r2 = _req(affinity={"required": [{"key": "zone", "operator": "In", "values": ["b", "a"]}]})
    assert class_id(r1) == class_id(r2)


def test_a_single_gpu_job_ignores_the_interconnect_in_its_class() -> None:
    assert class_id(_req(gpu_count=1, gpu_interconnect="nvlink")) == class_id(_req(gpu_count=1))


def test_jobs_without_hard_constraints_need_no_routing() -> None:
    assert not has_hard_constraints(_req(accelerator="cpu", timeout_seconds=10, model_id="m"))
    assert has_hard_constraints(_req(accelerator="cpu", cpu_cores=4))


def test_the_queue_name_is_logical_queue_ml_class_band() -> None:
    req = _req(gpu_count=1, priority_class="spot")
    assert queue_name("celery", req) == f"celery.ml.{class_id(req)}.spot"
    assert band(_req(gpu_count=1)) == "on-demand"


def test_pcie_is_acceptable_everywhere_so_it_does_not_split_classes() -> None:
    """§3.2: `pcie` means PCIe is acceptable; only `nvlink` is a hard requirement."""
    assert class_id(_req(gpu_count=2, gpu_interconnect="pcie")) == class_id(_req(gpu_count=2))
    assert class_id(_req(gpu_count=2, gpu_interconnect="nvlink")) != class_id(_req(gpu_count=2))
