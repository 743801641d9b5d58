"""`bench/replay_time.py`: tiny replays of the three policies, checked as they run."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench.replay_sim import BAND_RANK, Core, Job, Sim, Worker
from bench.replay_time import FAIR_WEIGHTS, POLICIES, Config, build, metrics
from bench.replay_time import dispatcher as dispatch_of
from celery_ojs_ml.testing.builders import worker_with

TINY = Config(workers=4, gpus=16, jobs=60)


def dispatcher(policy: str) -> Callable[[Sim], None]:
    return dispatch_of(policy, Core())


def never_over(sim: Sim, started: list[str]) -> None:
    """No worker holds more GPUs, cores or memory than it has."""
    for w in sim.workers.values():
        runs = [r.job for r in w.running.values()]
        assert sum(j.gpus for j in runs) <= w.gpus
        assert sum(j.cpu for j in runs) <= w.cpu + 1e-6
        assert sum(j.mem for j in runs) <= w.mem + 1e-6


@pytest.mark.parametrize("policy", POLICIES)
def test_every_job_finishes_exactly_once_within_capacity(policy: str) -> None:
    workers, jobs, _ = build(TINY, seed=1, load=1.3)
    sim = Sim(workers, jobs, seed=1)
    sim.run(dispatcher(policy), never_over)
    assert sorted(sim.finish) == sorted(j.id for j in jobs)
    assert sim.finished == len(jobs) == len(sim.first_start)
    m = metrics(sim)
    assert m["jct_ratio"] >= 1.0
    assert 0.0 <= m["idle_while_waiting_pct"] <= m["idle_if_packed_pct"] + 1e-9
    assert m["idle_if_packed_pct"] <= m["idle_in_total_pct"] + 1e-9
    share = m["fair_share"]
    assert set(share["share_pct"]) == set(FAIR_WEIGHTS)
    held = [v for v in share["share_pct"].values() if v is not None]
    assert not held or abs(sum(held) - 100.0) < 1e-6


def test_strict_never_starts_a_job_while_an_earlier_one_waits() -> None:
    def key(j: Job) -> tuple[int, int]:
        return (BAND_RANK[j.band], j.order)

    def in_order(sim: Sim, started: list[str]) -> None:
        for job_id in started:
            ahead = [j.id for j in sim.waiting.values() if key(j) < key(sim.jobs[job_id])]
            assert not ahead, f"{job_id} started while {ahead} wait"

    workers, jobs, _ = build(TINY, seed=2, load=1.3)
    sim = Sim(workers, jobs, seed=2)
    sim.run(dispatcher("strict"), in_order)
    assert sim.preemptions == 0


def starving() -> tuple[list[Worker], list[Job]]:
    """Two 4-GPU workers kept full by 1-GPU jobs; a 4-GPU on-demand job arrives among them."""
    workers = [
        Worker(name, 4, 32.0, 128.0, worker_with(gpus=4, worker_id=name)) for name in ("a", "b")
    ]
    jobs = [Job(f"s{i:03d}", i, 5.0 * i, 1, 1.0, 4.0, "on-demand", 40.0) for i in range(120)]
    jobs.insert(4, Job("big", 4, 21.0, 4, 4.0, 16.0, "on-demand", 100.0))
    jobs = [
        Job(j.id, n, j.arrival, j.gpus, j.cpu, j.mem, j.band, j.duration)
        for n, j in enumerate(jobs)
    ]
    return workers, jobs


def big_wait(policy: str) -> float:
    workers, jobs = starving()
    sim = Sim(workers, jobs, seed=0)
    sim.run(dispatcher(policy), never_over)
    return sim.first_start["big"] - sim.jobs["big"].arrival


def test_ojs_does_not_starve_a_big_job_that_pull_starves() -> None:
    pulled, scheduled = big_wait("pull"), big_wait("ojs")
    assert pulled > 400.0  # pull: the 1-GPU stream keeps taking every freed GPU
    assert scheduled <= 60.0  # ojs: a reservation drains one worker within a job length
    assert scheduled <= pulled


def test_idle_if_packed_counts_what_a_waiting_job_could_use_had_its_workers_been_packed() -> None:
    workers = [Worker(n, 4, 32.0, 128.0, worker_with(gpus=4, worker_id=n)) for n in "ab"]
    jobs = [
        Job("x", 0, 0.0, 2, 1.0, 4.0, "reserved", 100.0),
        Job("y", 1, 0.0, 2, 1.0, 4.0, "reserved", 100.0),
        Job("four", 2, 0.0, 4, 4.0, 16.0, "reserved", 100.0),
        Job("fat", 3, 0.0, 2, 40.0, 16.0, "reserved", 100.0),  # more cores than any worker
    ]
    sim = Sim(workers, jobs)
    sim.waiting = {j.id: j for j in jobs[:3]}
    sim.start("x", "a")
    sim.start("y", "b")
    # 2 + 2 GPUs free on two workers: the 4-GPU job fits neither, but would fit packed.
    assert (sim.idle_while_waiting(), sim.idle_if_packed(), sim.idle_in_total()) == (0, 4, 4)
    sim.waiting = {"fat": jobs[3]}  # no worker can ever hold it: nothing is idle for it
    assert (sim.idle_if_packed(), sim.idle_in_total()) == (0, 4)


def queued_stream() -> tuple[list[Worker], list[Job]]:
    """One 4-GPU worker; team-b's 20 jobs come first in order, then team-a's 20."""
    workers = [Worker("w", 4, 32.0, 128.0, worker_with(gpus=4, worker_id="w"))]
    jobs = [
        Job(f"{team}{i:02d}", n, 0.0, 1, 1.0, 4.0, "on-demand", 100.0, f"team-{team}")
        for n, (team, i) in enumerate([("b", i) for i in range(20)] + [("a", i) for i in range(20)])
    ]
    return workers, jobs


@pytest.mark.parametrize(("policy", "low", "high"), [("pull", 0.0, 10.0), ("fair", 55.0, 80.0)])
def test_fair_share_hands_the_contended_gpus_out_by_weight(
    policy: str, low: float, high: float
) -> None:
    """team-a weighs 2, team-b 1: under contention `fair` gives team-a about 2/3 of the
    GPUs; `pull` (FIFO) gives it none until team-b's jobs are all started."""
    workers, jobs = queued_stream()
    sim = Sim(workers, jobs)
    sim.run(dispatcher(policy), never_over)
    share = metrics(sim)["fair_share"]
    assert share["target_pct"]["team-a"] == pytest.approx(200 / 3)
    assert low <= share["share_pct"]["team-a"] <= high
    assert share["contended_pct"] > 0.0
