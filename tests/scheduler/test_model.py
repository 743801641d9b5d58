"""The core's values: builders derive what the spec and the gate derive; bad input teaches."""

from __future__ import annotations

import pytest

from celery_ojs_ml.scheduler import PendingJob, Policy, RunningJob, WorkerState
from celery_ojs_ml.wire.settings import read_settings
from tests.scheduler.helpers import caps, req


def test_a_pending_job_takes_its_band_time_limit_and_class_from_its_requirements() -> None:
    pending = PendingJob("j", req(gpu_count=2, priority_class="spot", timeout_seconds=600))
    assert (pending.band, pending.time_limit_s, len(pending.class_key)) == ("spot", 600.0, 16)


def test_an_unknown_gpu_affinity_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"use one of pack, spread, dedicated .* e\.g\. \"pack\""):
        PendingJob("j", req(gpu_count=1), gpu_affinity="scatter")  # type: ignore[arg-type]


def test_a_running_job_counts_what_the_gate_counts() -> None:
    r = RunningJob.of("r", req(gpu_count=2, memory_gb=16, priority_class="spot"), 5.0)
    assert (r.gpus, r.cpu_cores, r.memory_gb, r.band, r.preemptible) == (2, 0.0, 16.0, "spot", True)
    assert r.ends_at is None


def test_a_worker_built_from_its_running_jobs_has_the_rest_free() -> None:
    r = RunningJob.of("r", req(gpu_count=3, cpu_cores=10), 0.0)
    w = WorkerState.of("w", caps("nvidia-a100x8"), [r])
    assert (w.free.gpus, w.free.cpu_cores, w.free.memory_gb) == (5, 86, 1024)


def test_the_policy_reads_the_ojs_ml_settings_it_knows() -> None:
    settings = read_settings(
        {
            "ojs_ml_allow_on_demand_preemption": True,
            "ojs_ml_locality_weight": 20,
            "ojs_ml_deny_unsatisfiable": True,
        }
    )
    policy = Policy.from_settings(settings)
    assert (policy.allow_on_demand_preemption, policy.locality_weight) == (True, 20)
    assert (policy.deny_unsatisfiable, policy.reservation_depth) == (True, 1)
