"""What FGD's fragment counts here beyond GPUs and CPU: memory, scarce GPU models, share scale."""

from __future__ import annotations

from celery_ojs_ml.allocator.sharing import FULL
from celery_ojs_ml.scheduler import DEFAULT_POLICY, Workload
from celery_ojs_ml.scheduler.frag import Kind, Mix, by_access, fragment, growth, kind_of
from celery_ojs_ml.scheduler.score import (
    SHARE_SCALE,
    WHOLE_SCALE,
    fgd_points,
    gpus_by_model,
    placement,
)
from celery_ojs_ml.scheduler.vectors import INF
from tests.scheduler.helpers import caps, decide, job, worker

IDLE8 = (FULL,) * 8


def test_a_worker_short_of_memory_for_a_kind_is_all_fragment_for_it() -> None:
    big = Kind(cpu=4, gpus=1, memory=64)
    assert fragment("a100", 32, (FULL, FULL), big, mem_free=32) == 2 * FULL
    assert fragment("a100", 32, (FULL, FULL), big, mem_free=128) == 0
    assert fragment("a100", 32, (FULL, FULL), big) == 0  # memory not tracked


def test_taking_the_memory_a_typical_job_needs_grows_fragmentation() -> None:
    mix = Mix.of([Kind(cpu=1, gpus=1, memory=32)])
    hungry = growth("a100", 16, (FULL,) * 4, Kind(cpu=1, gpus=1, memory=48), mix, 64)
    frugal = growth("a100", 16, (FULL,) * 4, Kind(cpu=1, gpus=1, memory=16), mix, 64)
    assert hungry is not None and frugal is not None
    assert hungry[0] == 3 * FULL  # the three GPUs left can no longer start one
    assert frugal[0] == 0


def test_a_pending_jobs_kind_carries_its_memory() -> None:
    assert kind_of(job("a", gpu_count=1, memory_gb=64)).memory == 64
    assert kind_of(job("b", gpu_count=1)).memory == 0


def test_kinds_limited_to_a_scarce_model_weigh_more() -> None:
    mix = Mix.of([Kind(gpus=1), Kind(gpus=1, models=frozenset({"t4"}))])
    weighed = dict(by_access(mix, {"a100": 75, "t4": 25}).kinds)
    assert weighed[Kind(gpus=1)] == 1 / 3  # 1 / sqrt(1) against 1 / sqrt(0.25)
    assert weighed[Kind(gpus=1, models=frozenset({"t4"}))] == 2 / 3


def test_a_mix_without_model_limits_is_left_as_it_is() -> None:
    mix = Mix.of([Kind(gpus=1), Kind(gpus=2)])
    assert by_access(mix, {"a100": 75, "t4": 25}) is mix
    assert by_access(mix, {}) is mix


def test_the_fleets_gpus_are_counted_by_model() -> None:
    fleet = [caps("nvidia-a100x8"), caps("nvidia-l4x1"), caps("nvidia-a100x8"), caps("cpu")]
    assert gpus_by_model(fleet) == {"nvidia-a100": 16, "nvidia-l4": 1}


def _score(model: str, workload: Workload) -> float:
    want = (1.0, 1.0, 1.0, 0.0, 1.0)
    free = (8.0, 64.0, 256.0, INF, INF)
    totals = (8.0, 64.0, 256.0, 0.0, 0.0)
    return placement(
        want, free, totals, 100.0, workload, "pack", DEFAULT_POLICY, devices=IDLE8, model=model
    ).total


def test_an_unconstrained_job_leaves_the_scarce_model_to_the_jobs_that_need_it() -> None:
    common, scarce = frozenset({"g2"}), frozenset({"g3"})
    kinds = [Kind(gpus=1)] * 7 + [Kind(gpus=1, models=common)] * 2 + [Kind(gpus=1, models=scarce)]
    flat = Workload.of_kinds(kinds)
    weighed = Workload.of_kinds(kinds, models={"g2": 4000, "g3": 300})
    # FGD alone counts only jobs: more of them refuse g3, so g3 looks the better place
    assert _score("g3", flat) > _score("g2", flat)
    assert _score("g2", weighed) > _score("g3", weighed)


def test_the_pass_weighs_kinds_by_the_fleets_models() -> None:
    fleet = [worker(f"a{i}", "nvidia-a100x8") for i in range(8)] + [worker("h", "nvidia-h100x8")]
    pending = [job("any", gpu_count=1)]
    pending += [job(f"any{i}", gpu_count=1, at=1.0) for i in range(6)]
    pending += [job(f"a100-{i}", gpu_count=1, gpu_type="nvidia-a100", at=1.0) for i in range(2)]
    pending += [job("h100", gpu_count=1, gpu_type="nvidia-h100", at=1.0)]
    placed = {a.task_id: a.worker for a in decide(pending, fleet).assignments}
    # by jobs alone the h100 worker would take it (fewer jobs can use only it)
    assert placed["any"].startswith("a")
    assert placed["h100"] == "h"


def test_a_workload_with_gpu_shares_scores_growth_on_a_finer_scale() -> None:
    whole = Workload.of_kinds([Kind(gpus=1), Kind(cpu=4), Kind(gpus=8)])
    shared = Workload.of_kinds([Kind(gpus=1), Kind(gpus=1, milli=300)])
    assert whole.scale == WHOLE_SCALE == 1000  # FGD's: one GPU
    assert shared.scale == SHARE_SCALE < WHOLE_SCALE
    # growths 20 milli apart tie on FGD's scale; with shares they no longer do
    assert fgd_points(10.0, whole.scale) == fgd_points(30.0, whole.scale)
    assert fgd_points(10.0, shared.scale) > fgd_points(30.0, shared.scale)


def test_the_placement_scores_growth_on_the_workloads_scale() -> None:
    kinds = [Kind(gpus=1, milli=500), Kind(gpus=2)]
    shared = Workload.of_kinds(kinds)
    coarse = Workload(shared.shares, shared.largest, shared.mix, WHOLE_SCALE)
    want = (1.0, 1.0, 1.0, 0.0, 1.0)
    free = (2.0, 64.0, 256.0, INF, INF)
    totals = (2.0, 64.0, 256.0, 0.0, 0.0)
    fine, wide = (
        placement(want, free, totals, 0.0, w, "pack", DEFAULT_POLICY, devices=(FULL, FULL))
        for w in (shared, coarse)
    )
    # a whole GPU taken from an idle pair leaves one GPU a 2-GPU job cannot use
    assert fine.fragmentation == fgd_points(FULL / 2, SHARE_SCALE)
    assert wide.fragmentation == fgd_points(FULL / 2) > fine.fragmentation
