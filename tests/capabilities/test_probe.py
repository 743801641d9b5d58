"""Detecting GPUs through NVML (faked) and the host through psutil."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from celery_ojs_ml.capabilities import GpuDevice, probe, probe_devices
from celery_ojs_ml.capabilities.probe import gpu_type_from_name, vram_gb
from celery_ojs_ml.testing.fake_nvml import (
    A100_40GB,
    A100_80GB,
    H100_80GB,
    L4,
    MIB,
    RTX_4090,
    T4,
    FakeGpu,
    FakeNVML,
)

GIB = 1024**3


class FakePsutil:
    """psutil's four calls, answering for a 96-core, 1 TiB host."""

    def __init__(self, *, shm_error: bool = False) -> None:
        self.shm_error = shm_error

    def cpu_count(self, logical: bool = True) -> int:
        return 96

    def virtual_memory(self) -> Any:
        return SimpleNamespace(total=1024 * GIB - 300 * MIB)

    def disk_usage(self, path: str) -> Any:
        if path == "/dev/shm" and self.shm_error:
            raise FileNotFoundError(path)
        return SimpleNamespace(total=64 * GIB, free=(2000 if path == "/" else 64) * GIB)


def test_eight_nvlink_a100s_are_one_nvlink_gpu_group() -> None:
    worker = probe(nvml=FakeNVML.of(A100_80GB, 8), psutil_mod=FakePsutil())
    assert worker.accelerator == "gpu"
    assert worker.gpu is not None
    assert worker.gpu.model_dump() == {
        "type": "nvidia-a100",
        "count": 8,
        "memory_gb": 80,
        "compute_capability": "8.0",
        "interconnect": "nvlink",
        "nvlink_group": None,  # an NVSwitch board: all eight are peers of each other
    }
    assert worker.labels == {}


def test_two_t4s_on_pcie_report_the_catalogue_16_gb_not_the_15_gib_they_measure() -> None:
    worker = probe(nvml=FakeNVML.of(T4, 2), psutil_mod=FakePsutil())
    assert worker.gpu is not None
    assert (worker.gpu.type, worker.gpu.count, worker.gpu.memory_gb) == ("nvidia-t4", 2, 16)
    assert (worker.gpu.compute_capability, worker.gpu.interconnect) == ("7.5", "pcie")


def test_a_single_gpu_has_no_interconnect() -> None:
    worker = probe(nvml=FakeNVML.of(L4, 1), psutil_mod=FakePsutil())
    assert worker.gpu is not None
    assert (worker.gpu.type, worker.gpu.memory_gb, worker.gpu.interconnect) == (
        "nvidia-l4",
        24,
        None,
    )


def test_an_h100_measuring_79_6_gib_matches_a_job_asking_80_gb() -> None:
    worker = probe(nvml=FakeNVML.of(H100_80GB, 8), psutil_mod=FakePsutil())
    assert worker.derived_labels()["gpu_memory_gb"] == "80"


def test_an_a100_snaps_to_its_nearest_variant() -> None:
    assert vram_gb("nvidia-a100", A100_40GB.memory_bytes) == 40
    assert vram_gb("nvidia-a100", 79.2 * GIB) == 80
    assert vram_gb("nvidia-a100", 10 * GIB) == 10


def test_a_gpu_outside_the_catalogue_reports_floored_gib() -> None:
    worker = probe(nvml=FakeNVML.of(RTX_4090, 1), psutil_mod=FakePsutil())
    assert worker.gpu is not None
    assert (worker.gpu.type, worker.gpu.memory_gb, worker.gpu.compute_capability) == (
        "nvidia-rtx-4090",
        23.9,
        "8.9",
    )


def test_mixed_gpus_advertise_every_device_with_its_own_facts_and_flag_the_mix() -> None:
    """The summary never overclaims (the smallest VRAM); each device's facts say which
    jobs it serves (`capabilities.devices`)."""
    nvml = FakeNVML([T4, A100_80GB, A100_80GB])
    worker = probe(nvml=nvml, psutil_mod=FakePsutil())
    assert worker.gpu is not None
    assert (worker.gpu.type, worker.gpu.count, worker.gpu.memory_gb) == ("nvidia-a100", 3, 16)
    assert worker.labels == {"gpu_heterogeneous": "true", "gpu_types": "nvidia-a100,nvidia-t4"}
    assert [(d.type, d.memory_gb) for d in worker.gpu_devices] == [
        ("nvidia-t4", 16),
        ("nvidia-a100", 80),
        ("nvidia-a100", 80),
    ]
    assert [d.gpu_type for d in probe_devices(nvml)] == ["nvidia-t4", "nvidia-a100", "nvidia-a100"]


def test_mixed_gpus_in_equal_numbers_advertise_the_type_of_the_first_device() -> None:
    worker = probe(nvml=FakeNVML([L4, T4]), psutil_mod=FakePsutil())
    assert worker.gpu is not None
    assert (worker.gpu.type, worker.gpu.count) == ("nvidia-l4", 2)


def test_a_host_of_alike_gpus_advertises_no_per_device_facts() -> None:
    assert probe(nvml=FakeNVML.of(A100_80GB, 2), psutil_mod=FakePsutil()).gpu_devices == ()


def test_probe_devices_lists_each_device_for_the_allocator() -> None:
    assert probe_devices(FakeNVML.of(A100_80GB, 2)) == [
        GpuDevice(
            0,
            "NVIDIA A100-SXM4-80GB",
            "GPU-fake-0000",
            "nvidia-a100",
            80,
            "8.0",
            True,
            frozenset({1}),
        ),
        GpuDevice(
            1,
            "NVIDIA A100-SXM4-80GB",
            "GPU-fake-0001",
            "nvidia-a100",
            80,
            "8.0",
            True,
            frozenset({0}),
        ),
    ]


def test_probing_shuts_nvml_down_again() -> None:
    nvml = FakeNVML.of(T4, 1)
    probe(nvml=nvml, psutil_mod=FakePsutil())
    assert (nvml.initialised, nvml.shutdown_calls) == (False, 1)


@pytest.mark.parametrize(
    "nvml",
    [
        FakeNVML([A100_80GB], driver=False),
        FakeNVML([A100_80GB], init_error=OSError),
        FakeNVML([A100_80GB], init_error=ImportError),
        FakeNVML([]),
    ],
    ids=["no-driver", "library-fails-to-load", "import-fails", "zero-devices"],
)
def test_a_machine_without_usable_gpus_probes_as_a_clean_cpu_worker(nvml: FakeNVML) -> None:
    worker = probe(nvml=nvml, psutil_mod=FakePsutil())
    assert (worker.accelerator, worker.gpu, worker.gpu_count) == ("cpu", None, 0)
    assert worker.cpu_cores == 96


def test_a_missing_pynvml_module_probes_as_a_cpu_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    worker = probe(psutil_mod=FakePsutil())
    assert (worker.accelerator, worker.gpu) == ("cpu", None)


def test_the_host_is_measured_in_floored_gib() -> None:
    worker = probe(nvml=FakeNVML(), psutil_mod=FakePsutil())
    assert (worker.cpu_cores, worker.memory_gb, worker.storage_gb, worker.shm_size_gb) == (
        96,
        1023.7,
        2000,
        64,
    )


def test_a_host_without_dev_shm_leaves_the_shm_size_unknown() -> None:
    worker = probe(nvml=FakeNVML(), psutil_mod=FakePsutil(shm_error=True))
    assert worker.shm_size_gb is None


@pytest.mark.parametrize(
    ("name", "gpu_type"),
    [
        ("NVIDIA A100-SXM4-80GB", "nvidia-a100"),
        ("NVIDIA A100 80GB PCIe", "nvidia-a100"),
        ("NVIDIA H100 80GB HBM3", "nvidia-h100"),
        ("NVIDIA H100 NVL", "nvidia-h100"),
        ("NVIDIA H200", "nvidia-h200"),
        ("Tesla T4", "nvidia-t4"),
        ("Tesla V100-SXM2-16GB", "nvidia-v100"),
        ("NVIDIA L4", "nvidia-l4"),
        ("NVIDIA L40S", "nvidia-l40s"),
        ("NVIDIA A10G", "nvidia-a10g"),
        ("NVIDIA A10", "nvidia-a10"),
        ("NVIDIA B200", "nvidia-b200"),
        ("NVIDIA GeForce RTX 4090", "nvidia-rtx-4090"),
        ("NVIDIA RTX A6000", "nvidia-rtx-a6000"),
        ("NVIDIA GH200 480GB", "nvidia-gh200"),
    ],
)
def test_nvml_marketing_names_map_to_catalogue_ids(name: str, gpu_type: str) -> None:
    assert gpu_type_from_name(name) == gpu_type


def test_a_device_whose_compute_capability_is_unknown_leaves_the_group_value_unknown() -> None:
    class NoCC(FakeNVML):
        def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGpu) -> tuple[int, int]:
            raise self.NVMLError("Not Supported")

    worker = probe(nvml=NoCC([RTX_4090, RTX_4090]), psutil_mod=FakePsutil())
    assert worker.gpu is not None
    assert worker.gpu.compute_capability is None


def test_probing_this_machine_without_a_gpu_gives_a_cpu_worker() -> None:
    if probe_devices():
        pytest.skip("this machine has GPUs")
    worker = probe()
    assert (worker.accelerator, worker.gpu) == ("cpu", None)
    assert worker.cpu_cores is not None and worker.cpu_cores >= 1
    assert worker.memory_gb is not None and worker.memory_gb > 0
