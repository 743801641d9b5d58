"""Pool processes: every job runs in one of its worker's pool processes, so the fleet
scheduler counts them beside GPUs (`FreeCapacity.processes`, the fifth resource of
`scheduler.vectors`). A worker with a free process comes first among the workers where
a job fits now: on one whose processes are all busy the job would wait in the pool's
queue, holding its devices. Processes never make a job wait (the pool queues it)."""

from __future__ import annotations

from celery_ojs_ml.scheduler.vectors import covers
from tests.scheduler.helpers import decide, job, running, worker


def test_a_1_gpu_job_skips_a_worker_whose_only_process_is_busy() -> None:
    """Best fit alone picks `one-proc` (3 GPUs free against 4), whose single process
    runs a job: the new job would wait there for it while `four-proc` is idle."""
    busy = [running("r", gpu_count=1, limit=600)]
    fleet = [
        worker("one-proc", "nvidia-a100x4", busy, processes=1),
        worker("four-proc", "nvidia-a100x4", processes=4),
    ]
    assert decide([job("j", gpu_count=1)], fleet).assigned() == {"j": "four-proc"}
    untracked = [worker("one-proc", "nvidia-a100x4", busy), worker("four-proc", "nvidia-a100x4")]
    assert decide([job("j", gpu_count=1)], untracked).assigned() == {"j": "one-proc"}


def test_a_pass_fills_a_workers_free_processes_then_goes_elsewhere() -> None:
    """Best fit sends 1-GPU jobs to the 4-GPU worker before the 8-GPU one; it has one
    process, so the pass gives it one job and the others go where they start now."""
    fleet = [worker("four", "nvidia-a100x4", processes=1), worker("eight", processes=8)]
    jobs = [job(f"j{i}", at=i, gpu_count=1) for i in range(3)]
    assert decide(jobs, fleet).assigned() == {"j0": "four", "j1": "eight", "j2": "eight"}


def test_where_no_worker_has_a_free_process_the_job_still_starts_and_queues_in_the_pool() -> None:
    """Processes rank placements; they never hold a job back: with every process busy
    everywhere, the job goes where its GPUs are free, as before they were counted."""
    busy = [running("r", gpu_count=1, limit=600)]
    fleet = [worker("w", "nvidia-a100x4", busy, processes=1)]
    assert decide([job("j", gpu_count=1)], fleet).assigned() == {"j": "w"}
    assert covers((4.0, 0.0, 0.0, 0.0, 0.0), (1.0, 0.0, 0.0, 0.0, 1.0))


def test_a_gang_rank_goes_to_a_worker_with_a_free_process_before_a_tighter_fit() -> None:
    """Gang placement (`scheduler.gang`) ranks the same way: best fit alone puts a rank
    on `one-proc` (3 GPUs free), whose only process is busy, and every other rank would
    wait at the rendezvous for it; with processes counted the ranks go to idle workers,
    and a busy worker still takes a rank where nothing else is left."""
    from dataclasses import replace

    busy = [running("r", gpu_count=1, limit=600)]
    fleet = [
        worker("one-proc", "nvidia-a100x4", busy, processes=1),
        worker("idle-a", "nvidia-a100x4", processes=4),
        worker("idle-b", "nvidia-a100x4", processes=4),
    ]
    ranks = [
        replace(job(f"g-{r}", at=1, gpu_count=1), gang="g", gang_size=2, rank=r) for r in range(2)
    ]
    placed = decide(ranks, fleet).assigned()
    assert sorted(placed.values()) == ["idle-a", "idle-b"], placed
    three = [replace(r, gang_size=3) for r in ranks] + [
        replace(job("g-2", at=1, gpu_count=1), gang="g", gang_size=3, rank=2)
    ]
    assert sorted(decide(three, fleet).assigned().values()) == ["idle-a", "idle-b", "one-proc"]
