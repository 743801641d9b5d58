"""A gang's reservation (Flux RFC 27 backfill) and its place in order, budgets and fair share."""

from __future__ import annotations

from dataclasses import replace

from celery_ojs_ml.scheduler import Decision, PendingJob, Policy, WorkerState
from celery_ojs_ml.scheduler.budget import Budget
from celery_ojs_ml.scheduler.fair import fair_order
from tests.scheduler.helpers import NOW, decide, job, running, worker
from tests.scheduler.sim import Sim, SimWorker
from tests.scheduler.test_gang import ranks


def one_gpu_workers(ends: list[float]) -> list[WorkerState]:
    """One-GPU workers, the i-th running a job that reaches its time limit at `ends[i]`."""
    return [
        worker(f"w{i}", "nvidia-l4x1", jobs=[running(f"r{i}", gpu_count=1, limit=end - NOW + 600)])
        if end > NOW
        else worker(f"w{i}", "nvidia-l4x1")
        for i, end in enumerate(ends)
    ]


def gang_reserved(decision: Decision, gid: str) -> dict[str, tuple[str, float | None]]:
    return {
        r.task_id: (r.worker, r.start)
        for r in decision.reservations
        if r.task_id.startswith(f"{gid}-")
    }


def test_a_gang_that_cannot_start_reserves_the_time_enough_workers_free_for_all_ranks() -> None:
    """Flux RFC 27: the earliest time at which every rank has its own worker."""
    fleet = one_gpu_workers([NOW + 100, NOW + 200, NOW + 300, NOW + 400])
    decision = decide(ranks("g", 4, gpu_count=1, limit=1000), fleet)
    held = gang_reserved(decision, "g")
    assert sorted(held) == ["g-0", "g-1", "g-2", "g-3"]
    assert {start for _, start in held.values()} == {NOW + 400}
    assert len({w for w, _ in held.values()}) == 4, "two ranks hold one worker"
    assert decision.annotations["g-2"].t_estimate == NOW + 400
    assert "0/4 ranks can be placed now" in decision.annotations["g-2"].reason_pending


def test_a_small_job_that_would_delay_the_gang_is_not_backfilled_and_one_that_ends_before_is() -> (
    None
):
    """w0 is free now but the gang starts at NOW + 300 on all four workers."""
    fleet = one_gpu_workers([NOW, NOW + 300, NOW + 300, NOW + 300])
    gang = ranks("g", 4, gpu_count=1, limit=1000)
    long = job("long", at=2, gpu_count=1, limit=500)  # would end at NOW + 500
    short = job("short", at=3, gpu_count=1, limit=200)  # ends at NOW + 200
    alone = decide([*gang, long], fleet)
    assert alone.assignments == ()
    assert "1 reserved for g-" in alone.annotations["long"].reason_pending
    decision = decide([*gang, long, short], fleet)
    assert decision.assigned() == {"short": "w0"}
    assert {s for _, s in gang_reserved(decision, "g").values()} == {NOW + 300}


def test_a_gang_under_a_stream_of_small_jobs_starts_by_its_reservation_time() -> None:
    """Four one-GPU workers, a one-GPU job arriving every 25 s: without a reservation a
    freed worker always goes to the next small job and the gang never has all four."""
    started, reserved_at = run_stream(Policy())
    assert reserved_at is not None
    assert started is not None and started <= reserved_at


def test_without_a_reservation_the_same_stream_starves_the_gang() -> None:
    """`reservation_depth` 0: what the reservation above is for."""
    started, reserved_at = run_stream(Policy(reservation_depth=0))
    assert reserved_at is None
    assert started is None


def run_stream(policy: Policy) -> tuple[float | None, float | None]:
    """(when the gang started, when it was first reserved to start); None: never."""
    sim = Sim(now=NOW, policy=policy)
    for i in range(4):
        sim.workers[f"w{i}"] = SimWorker(worker(f"w{i}", "nvidia-l4x1").caps)
    for i, length in enumerate((60.0, 90.0, 120.0, 150.0)):
        sim.submit(job(f"s{i}", gpu_count=1, limit=length), length)
    sim.step()
    for rank in ranks("gang", 4, gpu_count=1, limit=600):
        sim.submit(rank, 600)
    reserved_at: float | None = None
    for n in range(80):
        decision = sim.step()
        held = gang_reserved(decision, "gang")
        if held and reserved_at is None:
            reserved_at = next(iter(held.values()))[1]
        if "gang-0" in sim.started:
            return sim.started["gang-0"], reserved_at
        sim.advance(25)
        sim.submit(job(f"t{n}", gpu_count=1, limit=120), 120)
    return None, reserved_at


def test_a_higher_band_job_submitted_after_a_gang_is_decided_before_it() -> None:
    """Gangs take their place in fleet order; they are no longer decided first."""
    fleet = one_gpu_workers([NOW, NOW, NOW, NOW])
    gang = [replace(r, band="spot") for r in ranks("g", 4, gpu_count=1, limit=100)]
    urgent = replace(job("urgent", at=5, gpu_count=1, limit=100), band="reserved")
    decision = decide([*gang, urgent], fleet)
    assert list(decision.assigned()) == ["urgent"]
    assert all(f"g-{r}" in decision.annotations for r in range(4))


def test_a_gang_over_its_queue_budget_waits_with_the_budget_reason_and_holds_nothing() -> None:
    """§10.3: the ranks' GPUs count together; over the budget nothing is reserved."""
    fleet = one_gpu_workers([NOW, NOW, NOW, NOW])
    budgets = (("celery", Budget(max_total_gpus=3)),)
    decision = decide(ranks("g", 4, gpu_count=1, limit=100), fleet, budgets=budgets)
    assert decision.assignments == () and decision.reservations == ()
    reason = decision.annotations["g-0"].reason_pending
    assert reason == "queue 'celery' budget: 0/3 GPUs in use (max_total_gpus); the job needs 4"


def test_a_gang_counts_one_gpu_job_per_rank_against_max_concurrent_gpu_jobs() -> None:
    fleet = one_gpu_workers([NOW, NOW, NOW, NOW])
    budgets = (("celery", Budget(max_concurrent_gpu_jobs=3)),)
    decision = decide(ranks("g", 4, gpu_count=1, limit=100), fleet, budgets=budgets)
    assert decision.assignments == ()
    assert "(max_concurrent_gpu_jobs)" in decision.annotations["g-3"].reason_pending
    placed = decide(ranks("g", 3, gpu_count=1, limit=100), fleet, budgets=budgets)
    assert len(placed.assignments) == 3


def test_fair_order_counts_every_rank_of_a_gang_against_its_queue() -> None:
    """The gang's lead stands for its 4 GPUs: queue b gets 4 jobs before a's next."""
    lead = replace(job("a-gang", at=0, queue="a", gpu_count=1), gang="g", gang_size=4)
    a2 = job("a2", at=1, queue="a", gpu_count=1)
    bs = [job(f"b{i}", at=2 + i, queue="b", gpu_count=1) for i in range(5)]
    order = [j.task_id for j, _ in fair_order([lead, a2, *bs], {}, {"a": 1.0, "b": 1.0})]
    assert order == ["a-gang", "b0", "b1", "b2", "b3", "a2", "b4"]


def test_a_gang_beyond_the_reservation_depth_gets_its_start_as_an_estimate_only() -> None:
    fleet = one_gpu_workers([NOW + 100, NOW + 200, NOW + 300, NOW + 400])
    ahead = job("ahead", at=0, gpu_count=1, limit=50, gpu_type="nvidia-h100")  # never fits
    pending: list[PendingJob] = [ahead, *ranks("g", 4, gpu_count=1, limit=1000)]
    decision = decide(
        pending,
        [*fleet, worker("h", "nvidia-h100x8", jobs=[running("x", gpu_count=8, limit=2000)])],
    )
    assert gang_reserved(decision, "g") == {}
    assert decision.annotations["g-0"].t_estimate == NOW + 400
