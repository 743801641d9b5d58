"""Device mapping: the probe reads NVLink peers per device (NVML P2P status) and
maps them onto the worker's allocation indices."""

from __future__ import annotations

from celery_ojs_ml.capabilities.probe import advertised_peers, probe, probe_devices
from celery_ojs_ml.matching import Verdict, match
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.testing.builders import worker_with
from celery_ojs_ml.testing.fake_nvml import FakeNVML
from celery_ojs_ml.worker.core import nvlink_peers_for
from tests.capabilities.test_probe import A100_80GB, T4, FakePsutil


def bridged() -> FakeNVML:
    """Four A100s bridged in pairs: 0-1 and 2-3."""
    return FakeNVML(FakeNVML.of(A100_80GB, 4).devices, nvlink_pairs=[(0, 1), (2, 3)])


def test_the_probe_reads_each_devices_nvlink_peers() -> None:
    peers = {d.index: d.peers for d in probe_devices(bridged(), None)}
    assert peers == {0: {1}, 1: {0}, 2: {3}, 3: {2}}


def test_an_nvswitch_board_links_every_device_to_every_other() -> None:
    devices = probe_devices(FakeNVML.of(A100_80GB, 4), None)
    assert all(d.peers == frozenset(range(4)) - {d.index} for d in devices)


def test_devices_without_nvlink_have_no_peers() -> None:
    devices = probe_devices(FakeNVML.of(T4, 2), None)
    assert [d.peers for d in devices] == [frozenset(), frozenset()]


def test_peers_are_mapped_onto_allocation_indices_of_the_visible_devices() -> None:
    assert advertised_peers(bridged(), env={}) == [{1}, {0}, {3}, {2}]
    # CUDA numbers the visible devices 0, 1, 2 in this order: devices 3, 2 and 1.
    env = {"CUDA_VISIBLE_DEVICES": "3,2,1"}
    assert advertised_peers(bridged(), env=env) == [{1}, {0}, frozenset()]


def test_without_the_p2p_call_peers_are_unknown_and_any_set_counts_as_linked() -> None:
    class OldNVML(FakeNVML):
        nvmlDeviceGetP2PStatus = None  # type: ignore[assignment]

    nvml = OldNVML(FakeNVML.of(A100_80GB, 2).devices)
    assert [d.peers for d in probe_devices(nvml, None)] == [None, None]
    assert advertised_peers(nvml, env={}) is None


def test_declared_capabilities_never_probe_for_peers() -> None:
    caps = worker_with(gpus=4, interconnect="nvlink")
    assert nvlink_peers_for("profile:nvidia-a100x8", caps) is None
    assert nvlink_peers_for("auto", worker_with(gpus=4, interconnect="pcie")) is None


def test_bridged_pairs_advertise_nvlink_with_a_group_of_two() -> None:
    caps = probe(nvml=bridged(), psutil_mod=FakePsutil())
    assert caps.gpu is not None
    assert (caps.gpu.interconnect, caps.gpu.nvlink_group) == ("nvlink", 2)
    full = probe(nvml=FakeNVML.of(A100_80GB, 4), psutil_mod=FakePsutil())
    assert full.gpu is not None and (full.gpu.interconnect, full.gpu.nvlink_group) == (
        "nvlink",
        None,
    )


def test_matching_never_places_a_linked_job_larger_than_the_workers_nvlink_group() -> None:
    """§3.2 `ext_ml_gpu_interconnect`: the scheduler must not send a 4-GPU NVLink job to
    a worker whose GPUs are linked in pairs only; a 2-GPU one fits."""
    caps = probe(nvml=bridged(), psutil_mod=FakePsutil())
    four = normalize({"ext_ml_gpu_count": 4, "ext_ml_gpu_interconnect": "nvlink"})
    two = normalize({"ext_ml_gpu_count": 2, "ext_ml_gpu_interconnect": "nvlink"})
    seen = match(four.requirements, caps)
    assert seen.verdict is Verdict.NEVER
    assert [r.message for r in seen.reasons] == ["gpu_interconnect: NVLink-peer GPUs 2 < 4"]
    assert match(two.requirements, caps).verdict is Verdict.FITS
