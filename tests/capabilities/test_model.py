"""The capability model: catalogue fill, accelerator inference, derived labels."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from celery_ojs_ml.capabilities import Capabilities, GpuCapability, LoadedModel, TpuCapability
from celery_ojs_ml.testing.builders import worker_with


def test_an_a100_of_undeclared_size_is_filled_with_the_smallest_catalogue_variant() -> None:
    gpu = GpuCapability(type="nvidia-a100", count=4)
    assert gpu.memory_gb == 40
    assert gpu.compute_capability == "8.0"


def test_declared_vram_and_compute_capability_win_over_the_catalogue() -> None:
    gpu = GpuCapability(type="nvidia-a100", count=4, memory_gb=80, compute_capability="8.0")
    assert (gpu.memory_gb, gpu.compute_capability) == (80, "8.0")
    mig = GpuCapability(type="nvidia-a100", count=1, memory_gb=10)
    assert mig.memory_gb == 10


def test_a_gpu_outside_the_catalogue_gets_no_filled_values() -> None:
    gpu = GpuCapability(type="nvidia-rtx-4090", count=1)
    assert (gpu.memory_gb, gpu.compute_capability) == (None, None)


def test_an_amd_gpu_gets_vram_but_no_compute_capability_from_the_catalogue() -> None:
    gpu = GpuCapability(type="amd-mi300x", count=8)
    assert (gpu.memory_gb, gpu.compute_capability) == (192, None)


@pytest.mark.parametrize(
    ("fields", "accelerator"),
    [
        ({"gpu": {"type": "nvidia-t4", "count": 1}}, "gpu"),
        ({"gpu": {"type": "nvidia-t4", "count": 0}}, "cpu"),
        ({"tpu": {"type": "v5e", "topology": "2x4"}}, "tpu"),
        ({"cpu_cores": 8}, "cpu"),
        ({"accelerator": "fpga"}, "fpga"),
    ],
    ids=["gpus-mean-gpu", "zero-gpus-mean-cpu", "a-tpu-means-tpu", "nothing-means-cpu", "declared"],
)
def test_the_accelerator_is_inferred_when_the_worker_does_not_declare_it(
    fields: dict[str, object], accelerator: str
) -> None:
    assert Capabilities.model_validate(fields).accelerator == accelerator


def test_a_worker_without_gpus_has_a_gpu_count_of_zero() -> None:
    assert worker_with(gpus=0).gpu_count == 0
    assert worker_with(gpus=0).gpu is None
    assert worker_with(gpus=4).gpu_count == 4


def test_derived_labels_describe_the_hardware_in_canonical_form() -> None:
    worker = worker_with(
        gpus=8,
        memory_gb=80.0,
        interconnect="nvlink",
        cpu_cores=96,
        ram_gb=1024.0,
        labels={"region": "us-east-1"},
        worker_id="gpu-worker-01",
        storage_gb=8000,
        shm_size_gb=256,
    )
    assert worker.derived_labels() == {
        "region": "us-east-1",
        "accelerator": "gpu",
        "gpu_type": "nvidia-a100",
        "gpu_count": "8",
        "gpu_memory_gb": "80",
        "compute_capability": "8.0",
        "gpu_interconnect": "nvlink",
        "cpu_cores": "96",
        "memory_gb": "1024",
        "storage_gb": "8000",
        "shm_size_gb": "256",
        "worker_id": "gpu-worker-01",
    }


def test_fractional_sizes_keep_their_decimals_and_compute_capability_stays_a_version() -> None:
    worker = worker_with(gpus=1, gpu_type="nvidia-b200", memory_gb=179.5, ram_gb=23.5)
    labels = worker.derived_labels()
    assert (labels["gpu_memory_gb"], labels["memory_gb"]) == ("179.5", "23.5")
    assert labels["compute_capability"] == "10.0"


def test_own_labels_cannot_override_the_hardware_derived_labels() -> None:
    worker = worker_with(
        gpus=4, labels={"gpu_type": "nvidia-h100", "gpu_count": "99", "zone": "us-east-1a"}
    )
    labels = worker.derived_labels()
    assert (labels["gpu_type"], labels["gpu_count"], labels["zone"]) == (
        "nvidia-a100",
        "4",
        "us-east-1a",
    )


def test_an_own_label_naming_hardware_the_worker_lacks_is_dropped() -> None:
    worker = worker_with(gpus=0, labels={"gpu_type": "nvidia-h100", "spot": "true"})
    labels = worker.derived_labels()
    assert "gpu_type" not in labels
    assert (labels["gpu_count"], labels["accelerator"], labels["spot"]) == ("0", "cpu", "true")


def test_a_tpu_worker_derives_tpu_labels_and_its_chip_count_from_the_topology() -> None:
    worker = worker_with(tpu={"type": "v5e", "topology": "2x4"})
    labels = worker.derived_labels()
    assert worker.accelerator == "tpu"
    assert (labels["tpu_type"], labels["tpu_topology"], labels["tpu_chip_count"]) == (
        "v5e",
        "2x4",
        "8",
    )
    assert TpuCapability(type="v4", topology="2x2x4").chip_count == 16


def test_derived_labels_are_a_copy_the_caller_may_change() -> None:
    worker = worker_with(gpus=1)
    worker.derived_labels()["gpu_type"] = "nvidia-h100"
    assert worker.derived_labels()["gpu_type"] == "nvidia-a100"


def test_a_copy_with_a_new_worker_id_derives_the_new_id() -> None:
    worker = worker_with(gpus=1).model_copy(update={"worker_id": "celery@gpu-1"})
    assert worker.derived_labels()["worker_id"] == "celery@gpu-1"


def test_capabilities_are_frozen_and_equal_by_value() -> None:
    worker = worker_with(gpus=2)
    with pytest.raises(ValidationError):
        worker.cpu_cores = 64  # type: ignore[misc]
    assert worker == worker_with(gpus=2)


def test_json_label_values_become_strings() -> None:
    worker = Capabilities.model_validate({"labels": {"spot": True, "rack": 12, "ratio": 1.5}})
    assert worker.labels == {"spot": "true", "rack": "12", "ratio": "1.5"}


def test_a_numeric_compute_capability_is_read_as_major_minor() -> None:
    assert GpuCapability(type=None, count=1, compute_capability=8.6).compute_capability == "8.6"  # type: ignore[arg-type]
    assert GpuCapability(type=None, count=1, compute_capability=9).compute_capability == "9.0"  # type: ignore[arg-type]


def test_a_loaded_model_may_be_given_as_its_id() -> None:
    worker = Capabilities.model_validate({"models_loaded": ["llama-3.1-8b"]})
    assert worker.models_loaded == (LoadedModel(model_id="llama-3.1-8b"),)
    assert worker.model_registry_access is False  # §4 pinning by default


def test_the_builder_records_loaded_models_with_their_versions() -> None:
    worker = worker_with(models=[("llama-3.1-70b", "v2.1"), ("bert", None)])
    assert [(m.model_id, m.model_version) for m in worker.models_loaded] == [
        ("llama-3.1-70b", "v2.1"),
        ("bert", None),
    ]
