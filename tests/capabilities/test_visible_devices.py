"""Device mapping: the probe and the pinning respect an inherited
CUDA_VISIBLE_DEVICES (indices or UUIDs) or a UUID NVIDIA_VISIBLE_DEVICES."""

from __future__ import annotations

import pytest

from celery_ojs_ml.capabilities.probe import (
    advertised_tokens,
    probe,
    probe_devices,
    visible_tokens,
)
from celery_ojs_ml.child import pinning as child
from celery_ojs_ml.testing.fake_nvml import FakeNVML
from tests.capabilities.test_probe import A100_80GB, T4, FakePsutil


@pytest.mark.parametrize(
    ("env", "tokens"),
    [
        ({}, None),
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, ["2", "3"]),
        ({"CUDA_VISIBLE_DEVICES": ""}, []),
        ({"CUDA_VISIBLE_DEVICES": "1", "NVIDIA_VISIBLE_DEVICES": "GPU-a"}, ["1"]),
        ({"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, ["GPU-a", "GPU-b"]),
        ({"NVIDIA_VISIBLE_DEVICES": "2,3"}, None),  # the runtime renumbered already
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, None),
    ],
)
def test_visible_tokens_read_the_environment(env: dict[str, str], tokens: list[str] | None) -> None:
    assert visible_tokens(env) == tokens


def test_the_probe_lists_only_the_visible_devices_in_cuda_order() -> None:
    nvml = FakeNVML.of(A100_80GB, 4)
    assert [d.index for d in probe_devices(nvml, ["3", "1"])] == [3, 1]
    assert [d.index for d in probe_devices(nvml, ["GPU-fake-0002"])] == [2]
    assert [d.index for d in probe_devices(nvml, None)] == [0, 1, 2, 3]


def test_pinning_maps_allocation_indices_to_the_workers_own_devices() -> None:
    child.VISIBLE["tokens"] = ["2", "3"]
    try:
        assert child.pinned([0]) == "2" and child.pinned([0, 1]) == "2,3"
    finally:
        child.VISIBLE["tokens"] = None
    assert child.pinned([0, 1]) == "0,1"


def mixed() -> FakeNVML:
    """NVML order: A100, A100, T4, A100 (the advertised model is the A100, 3 of them)."""
    a100 = FakeNVML.of(A100_80GB, 4).devices
    t4 = FakeNVML.of(T4, 3).devices[2]
    return FakeNVML([a100[0], a100[1], t4, a100[3]])


def test_on_a_mixed_host_allocation_indices_name_every_device_by_its_nvml_index() -> None:
    """The worker advertises all 4 devices, each with its model (`gpu_devices`);
    allocation index 2 is the T4."""
    nvml = mixed()
    caps = probe(nvml=nvml, psutil_mod=FakePsutil())
    assert caps.gpu is not None and (caps.gpu.type, caps.gpu.count) == ("nvidia-a100", 4)
    assert [d.type for d in caps.gpu_devices] == ["nvidia-a100"] * 2 + ["nvidia-t4", "nvidia-a100"]
    tokens = advertised_tokens(nvml, env={})
    assert tokens == ["0", "1", "2", "3"]
    child.VISIBLE["tokens"] = tokens
    try:
        assert child.pinned([2]) == "2"
    finally:
        child.VISIBLE["tokens"] = None


def test_on_a_mixed_host_an_inherited_visible_list_keeps_its_own_names() -> None:
    nvml = mixed()
    env = {"CUDA_VISIBLE_DEVICES": "GPU-fake-0002,3,1"}  # the T4 by UUID, then two A100s
    assert advertised_tokens(nvml, env=env) == ["GPU-fake-0002", "3", "1"]


def test_on_a_host_of_one_model_the_tokens_are_the_inherited_ones() -> None:
    nvml = FakeNVML.of(A100_80GB, 4)
    assert advertised_tokens(nvml, env={}) is None
    assert advertised_tokens(nvml, env={"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert advertised_tokens(FakeNVML([]), env={"CUDA_VISIBLE_DEVICES": "1"}) == ["1"]
