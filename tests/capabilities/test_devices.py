"""Per-device facts (OJS ML §3.2, §11): MIG devices through NVML, and a mixed host's
devices, as advertised and as a job is matched against them (`capabilities.devices`)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.capabilities import capabilities_to_dict, parse_capabilities, probe
from celery_ojs_ml.capabilities.probe import advertised_tokens, probe_devices
from celery_ojs_ml.matching import match
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.testing.fake_nvml import A100_80GB, FakeNVML, mig_host, mixed_host
from tests.capabilities.test_probe import FakePsutil


def caps_of(nvml: FakeNVML) -> Any:
    return probe(nvml=nvml, psutil_mod=FakePsutil(), runtimes=())


def job(**attrs: Any) -> Any:
    return normalize({f"ext_ml_{k}": v for k, v in attrs.items()}).requirements


def test_a_gpu_in_mig_mode_is_offered_as_its_mig_devices_by_their_uuids() -> None:
    """nvmlDeviceGetMigMode, nvmlDeviceGetMaxMigDeviceCount and
    nvmlDeviceGetMigDeviceHandleByIndex (an empty slot is skipped)."""
    devices = probe_devices(mig_host(), visible=None)
    assert [(d.index, d.mig, d.memory_gb, d.token) for d in devices] == [
        (0, True, 40, "MIG-fake-00-00"),
        (0, True, 10, "MIG-fake-00-01"),
        (0, True, 10, "MIG-fake-00-03"),
        (1, False, 80, "1"),
    ]
    assert advertised_tokens(mig_host(), env={}) == [d.token for d in devices]


def test_a_mig_host_advertises_each_device_and_the_advert_parses_back() -> None:
    caps = caps_of(mig_host())
    assert caps.labels == {"gpu_mig": "true"}
    assert [(d.memory_gb, d.mig) for d in caps.gpu_devices] == [
        (40, True),
        (10, True),
        (10, True),
        (80, False),
    ]
    assert parse_capabilities(capabilities_to_dict(caps)) == caps


def test_a_gpu_without_mig_support_is_offered_whole() -> None:
    assert [d.mig for d in probe_devices(FakeNVML.of(A100_80GB, 2), visible=None)] == [False] * 2


@pytest.mark.parametrize(
    ("attrs", "verdict", "reason"),
    [
        ({"gpu_type": "nvidia-t4", "gpu_count": 1}, "FITS", ""),
        ({"gpu_type": "nvidia-a100", "gpu_count": 3}, "FITS", ""),
        ({"gpu_type": "nvidia-t4", "gpu_count": 2}, "NEVER", "gpu_count 1 < 2"),
        ({"gpu_type": "nvidia-a100", "gpu_count": 4}, "NEVER", "gpu_count 3 < 4"),
        ({"gpu_type": "nvidia-h100", "gpu_count": 1}, "NEVER", "gpu_type nvidia-a100 not in"),
    ],
    ids=[
        "one T4 on the host with one",
        "three A100s on the host with three",
        "two T4s on the host with one",
        "four A100s on the host with three",
        "a model the host lacks",
    ],
)
def test_a_mixed_host_is_matched_by_the_devices_of_the_jobs_model_section_3_2(
    attrs: dict[str, Any], verdict: str, reason: str
) -> None:
    found = match(job(**attrs), caps_of(mixed_host()))
    assert found.verdict.value == verdict
    assert reason in "; ".join(r.message for r in found.reasons)


def test_a_mig_host_serves_a_small_job_a_slice_and_no_two_gpu_job_a_slice() -> None:
    caps = caps_of(mig_host())
    assert match(job(gpu_type="nvidia-a100", gpu_memory_gb=10), caps).verdict.value == "FITS"
    two = match(job(gpu_type="nvidia-a100", gpu_count=2), caps)
    assert two.verdict.value == "NEVER"
    assert "gpu_count 1 < 2" in two.reasons[0].message
