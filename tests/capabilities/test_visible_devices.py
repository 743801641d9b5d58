"""Device mapping (issue 13): the probe and the pinning respect an inherited
CUDA_VISIBLE_DEVICES (indices or UUIDs) or a UUID NVIDIA_VISIBLE_DEVICES."""

from __future__ import annotations

import pytest

from celery_ojs_ml.capabilities.probe import probe_devices, visible_tokens
from celery_ojs_ml.integration import child
from celery_ojs_ml.testing.fake_nvml import FakeNVML
from tests.capabilities.test_probe import A100_80GB


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
