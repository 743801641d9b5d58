"""The scheduler places `nvlink` jobs on free NVLink islands (device mapping: "a job asking for
`nvlink` gets devices that are NVLink peers of each other"). A worker reports the most
free devices that are all peers (`WorkerState.nvlink_free`); a job that asks for more
peers than that does not start there now, so the gate never has to give it back."""

from __future__ import annotations

import dataclasses

from celery_ojs_ml.scheduler import WorkerState
from tests.scheduler.helpers import decide, job, running, worker


def _islands(state: WorkerState, free_peers: int) -> WorkerState:
    return dataclasses.replace(state, nvlink_free=free_peers)


def _two_free(name: str, free_peers: int) -> WorkerState:
    """A 4-GPU NVLink worker with 2 GPUs busy; `free_peers` of its 2 free ones are peers."""
    busy = worker(name, "nvidia-a100x4", jobs=[running(f"{name}-busy", gpu_count=2, limit=600)])
    return _islands(busy, free_peers)


def test_a_2_gpu_nvlink_job_goes_where_its_free_gpus_are_peers_in_either_fleet_order() -> None:
    split, paired = _two_free("split", 1), _two_free("paired", 2)
    nvlink = job("nv", gpu_count=2, gpu_interconnect="nvlink")
    for fleet in ([split, paired], [paired, split]):
        assert decide([nvlink], fleet).assigned() == {"nv": "paired"}


def test_a_2_gpu_nvlink_job_waits_when_no_worker_has_two_free_peers() -> None:
    decision = decide([job("nv", gpu_count=2, gpu_interconnect="nvlink")], [_two_free("s", 1)])
    assert decision.assigned() == {}
    assert "nv" in decision.annotations


def test_a_job_without_nvlink_uses_free_gpus_that_are_not_peers() -> None:
    decision = decide([job("plain", gpu_count=2)], [_two_free("split", 1)])
    assert decision.assigned() == {"plain": "split"}


def test_one_pass_does_not_count_the_same_free_island_twice() -> None:
    """4 free GPUs of which 2 are peers: one 2-GPU nvlink job starts, the second waits
    (the gate may have used the island), instead of both being sent."""
    idle = _islands(worker("w", "nvidia-a100x4"), 2)
    jobs = [job(f"nv{i}", at=i, gpu_count=2, gpu_interconnect="nvlink") for i in range(2)]
    assert decide(jobs, [idle]).assigned() == {"nv0": "w"}


def test_a_worker_that_reports_no_islands_is_judged_by_its_free_gpus_alone() -> None:
    unknown = worker("w", "nvidia-a100x4")  # nvlink_free None: older worker, no NVML links
    nvlink = job("nv", gpu_count=2, gpu_interconnect="nvlink")
    assert decide([nvlink], [unknown]).assigned() == {"nv": "w"}
