"""GPU sharing in the fleet core (docs/sharing.md): a share job goes only where some device
has its milli-GPU left, a whole job never counts a partly used device as free, and shares
placed in one pass add up per device."""

from __future__ import annotations

from typing import Any

from celery_ojs_ml.scheduler import PendingJob, WorkerState
from celery_ojs_ml.spec.normalize import normalize
from tests.scheduler.helpers import caps, decide, job


def share(task_id: str, at: float = 0.0, **attrs: Any) -> PendingJob:
    """A share job: `ojs_ml_gpu_share` and other attributes by their wire names."""
    return PendingJob(task_id, normalize(attrs).requirements, submitted_at=at)


def sharing(name: str, free: tuple[int, ...], profile: str = "nvidia-a100x2") -> WorkerState:
    """A sharing worker whose devices have `free` milli-GPU left (its heartbeat's vector)."""
    return WorkerState.of(name, caps(profile, name), gpu_free_milli=free)


VRAM_40 = {"ojs_ml_gpu_share": True, "ext_ml_gpu_memory_gb": 40}  # 500 milli of an A100 80 GB


def test_a_share_job_never_goes_to_a_worker_without_sharing() -> None:
    plain = WorkerState.of("plain", caps("nvidia-a100x2", "plain"))
    assert decide([share("s", **VRAM_40)], [plain]).assigned() == {}


def test_a_share_job_never_goes_to_a_worker_with_no_device_that_has_its_milli_left() -> None:
    full = sharing("full", (400, 0))
    assert decide([share("s", **VRAM_40)], [full]).assigned() == {}


def test_a_share_job_goes_to_the_worker_with_a_device_that_has_its_milli_left() -> None:
    fleet = [sharing("full", (400, 0)), sharing("room", (600, 0))]
    assert decide([share("s", **VRAM_40)], fleet).assigned() == {"s": "room"}


def test_a_whole_job_does_not_count_a_partly_used_device_as_free() -> None:
    partly = sharing("partly", (999, 1000))
    assert decide([job("w2", gpu_count=2)], [partly]).assigned() == {}
    assert decide([job("w1", gpu_count=1)], [partly]).assigned() == {"w1": "partly"}


def test_shares_placed_in_one_pass_never_oversubscribe_a_device() -> None:
    pending = [share(f"s{i}", at=i, **VRAM_40) for i in range(5)]
    decision = decide(pending, [sharing("w", (1000, 1000))])
    assert len(decision.assigned()) == 4  # two 500-milli shares per device, the fifth waits


def test_a_share_opening_an_untouched_device_leaves_one_gpu_less_for_whole_jobs() -> None:
    decision = decide(
        [share("s", **VRAM_40), job("w2", at=1, gpu_count=2)], [sharing("w", (1000, 1000))]
    )
    assert decision.assigned() == {"s": "w"}


def test_a_fraction_share_fits_beside_vram_shares_up_to_1000_milli() -> None:
    pending = [share("v", **VRAM_40), share("f", at=1, ojs_ml_gpu_share=0.5)]
    assert decide(pending, [sharing("w", (1000, 0))]).assigned() == {"v": "w", "f": "w"}
    third = [*pending, share("g", at=2, ojs_ml_gpu_share=0.01)]
    assert decide(third, [sharing("w", (1000, 0))]).assigned() == {"v": "w", "f": "w"}


def test_a_share_fills_a_partly_used_device_before_it_opens_a_whole_one_fleet_wide() -> None:
    """FGD per GPU: opening an untouched device fragments it for whole-GPU jobs; filling
    the half-used device of another worker leaves every whole GPU whole."""
    waiting = [job("w1", at=1, gpu_count=1, node_selector={"pool": "later"})]
    for fleet in (
        [sharing("untouched", (1000, 1000)), sharing("half", (500, 1000))],
        [sharing("half", (500, 1000)), sharing("untouched", (1000, 1000))],
    ):
        decision = decide([share("s", **VRAM_40), *waiting], fleet)
        assert decision.assigned() == {"s": "half"}
        assert decision.assignments[0].score > 0


def test_a_share_leaves_the_leftover_that_other_shares_can_still_use() -> None:
    """Two half-used workers and a 0.3 share: best fit would leave 100 milli (usable by
    nothing in the workload); FGD leaves 200 on the other, which the waiting 0.2 shares
    can use, so fragmentation grows less there."""
    pending = [
        share("s", ojs_ml_gpu_share=0.3),
        *[share(f"f{i}", at=1 + i, ojs_ml_gpu_share=0.2, ext_ml_node_selector={"pool": "x"})
          for i in range(3)],
    ]  # fmt: skip
    for fleet in (
        [sharing("five", (500, 0)), sharing("four", (400, 0))],
        [sharing("four", (400, 0)), sharing("five", (500, 0))],
    ):
        assert decide(pending, fleet).assigned() == {"s": "five"}
