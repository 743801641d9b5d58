"""The worker's `inspect stats` entries: flat `ojs_ml.*` pairs Flower shows as rows (DESIGN §8)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from celery_ojs_ml.allocator import Allocation, Allocator, Pending
from celery_ojs_ml.capabilities import capabilities_to_dict
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.wire.warm_slots import TAINTED, mask_of
from celery_ojs_ml.worker.setup import capabilities_for
from celery_ojs_ml.worker.stats import flat_stats, warm_children


def req(**attrs: Any) -> MLRequirements:
    return normalize(attrs).requirements


ONE_GPU = req(ext_ml_gpu_count=1, ext_ml_cpu_cores=1, ext_ml_memory_gb=32)


def snapshot(allocator: Allocator, profile: str, **extra: Any) -> dict[str, Any]:
    """What `MLWorker.snapshot()` returns, for a worker declared by `profile`."""
    caps = capabilities_for(profile)
    return {
        "capabilities": capabilities_to_dict(caps)["capabilities"],
        "labels": caps.derived_labels(),
        "allocator": allocator.snapshot(),
        "queues": ["ojs.ml.w.a@host"],
        "pinning": True,
        "processes": 2,
        "plain_running": 0,
        **extra,
    }


def test_every_value_is_a_short_scalar_under_a_dotted_ojs_ml_key() -> None:
    allocator = Allocator(capabilities_for("profile:nvidia-a100x2"))
    assert isinstance(allocator.try_alloc("k", "job-1", ONE_GPU), Allocation)
    stats = flat_stats(snapshot(allocator, "profile:nvidia-a100x2"), leader=True)
    assert all(k.startswith("ojs_ml.") for k in stats)
    assert all(isinstance(v, str | int | float | bool) for v in stats.values()), stats
    assert stats["ojs_ml.gpus"] == "1/2 free (nvidia-a100 80 GB, nvlink)"
    assert stats["ojs_ml.devices"] == "0: job-1; free: 1"
    assert stats["ojs_ml.running"] == 1 and stats["ojs_ml.held"] == 0
    assert stats["ojs_ml.bands"] == "on-demand 1"
    assert stats["ojs_ml.leader"] is True
    assert stats["ojs_ml.queues"] == "ojs.ml.w.a@host"
    assert stats["ojs_ml.pinning"] == "CUDA_VISIBLE_DEVICES per task"
    assert stats["ojs_ml.processes"] == 2
    assert stats["ojs_ml.cpu"] == "23/24 cores, 224/256 GB memory free"
    assert "gpu_type=nvidia-a100" in str(stats["ojs_ml.labels"])
    assert "ojs_ml.waiting" not in stats and "ojs_ml.sharing" not in stats


def test_a_held_job_shows_with_the_reason_it_waits() -> None:
    allocator = Allocator(capabilities_for("profile:nvidia-a100x2"))
    assert isinstance(allocator.try_alloc("k1", "big", req(ext_ml_gpu_count=2)), Allocation)
    pending = allocator.try_alloc("k2", "next", req(ext_ml_gpu_count=1))
    assert isinstance(pending, Pending)
    allocator.hold(pending)
    stats = flat_stats(snapshot(allocator, "profile:nvidia-a100x2"), leader=False)
    assert stats["ojs_ml.held"] == 1 and stats["ojs_ml.leader"] is False
    assert stats["ojs_ml.devices"] == "0,1: big", "a job on two devices is named once"
    assert str(stats["ojs_ml.waiting"]).startswith("next (on-demand): ")
    assert pending.reason in str(stats["ojs_ml.waiting"])
    assert stats["ojs_ml.gpus"].startswith("0/2 free")  # type: ignore[union-attr]


def test_gpu_shares_show_their_milli_gpu_per_device_while_sharing_is_on() -> None:
    """docs/sharing.md: two 40 GB shares of an 80 GB device take 500 milli-GPU each."""
    allocator = Allocator(capabilities_for("profile:nvidia-a100x2"), gpu_sharing=True)
    for key in ("a", "b"):
        share = req(ojs_ml_gpu_share=True, ext_ml_gpu_memory_gb=40)
        assert isinstance(allocator.try_alloc(key, key, share), Allocation)
    stats = flat_stats(snapshot(allocator, "profile:nvidia-a100x2"), leader=False)
    assert stats["ojs_ml.devices"] == "0: a 500m, b 500m; free: 1"
    assert stats["ojs_ml.sharing"] == "milli-GPU free: 0: 0/1000, 1: 1000/1000"


def test_a_tpu_worker_shows_its_chips_and_no_gpus() -> None:
    allocator = Allocator(capabilities_for("profile:tpu-v5e-2x4"))
    stats = flat_stats(snapshot(allocator, "profile:tpu-v5e-2x4", pinning=False), leader=False)
    assert stats["ojs_ml.gpus"] == "none" and "ojs_ml.devices" not in stats
    assert stats["ojs_ml.tpus"] == "8/8 chips free (v5e 2x4)"
    assert stats["ojs_ml.pinning"] == "off (request.ojs_devices)"


def test_warm_children_count_the_bound_children_and_skip_tainted_ones() -> None:
    slots = {0: mask_of([0]), 1: mask_of([1, 2]), 2: TAINTED, 3: 0}
    pool = SimpleNamespace(_fileno_to_inq={10 + i: SimpleNamespace(index=i) for i in slots})
    table = SimpleNamespace(binding=slots.__getitem__)
    router = SimpleNamespace(pool=pool, table=table, warm_hits=7, retired=1)
    assert warm_children(router) == "2/4 bound: 0; 1,2, 7 warm starts, 1 retired"
    assert warm_children(None) is None
