"""Anti-affinity against running and assigned jobs, OJS ML §7.3.

§7.3: a required anti-affinity rule keeps the job off any worker where a
running job matches it (the replicas-on-different-workers use case); a
preferred one only lowers the score. Jobs' own labels are `job_type` (task
name), `queue` and their declared `ml_labels`.
"""

from __future__ import annotations

from dataclasses import replace

from celery_ojs_ml.scheduler import PendingJob
from tests.scheduler.helpers import decide, job, running, worker

APART = {"required": [{"key": "app", "operator": "In", "values": ["llm-serve"]}]}
PREFER_APART = {
    "preferred": [{"key": "app", "operator": "In", "values": ["llm-serve"], "weight": 100}]
}


def _replica(task_id: str, at: float, rule: dict = APART) -> PendingJob:  # type: ignore[type-arg]
    found = job(task_id, at=at, gpu_count=1, anti_affinity=rule)
    return replace(found, labels={"job_type": "serve", "app": "llm-serve"})


def test_replicas_with_required_anti_affinity_land_on_different_workers_in_one_pass() -> None:
    fleet = [worker(f"w{i}", profile="nvidia-a100x2") for i in range(3)]
    decision = decide([_replica(f"r{i}", at=i) for i in range(3)], fleet)
    assert sorted(decision.assigned().values()) == ["w0", "w1", "w2"]


def test_a_replica_waits_rather_than_join_a_running_replica_on_its_worker() -> None:
    serving = replace(running("live", gpu_count=1, limit=60), labels={"app": "llm-serve"})
    fleet = [worker("w0", profile="nvidia-a100x2", jobs=[serving])]
    decision = decide([_replica("r1", at=1)], fleet)
    assert decision.assignments == ()
    assert "anti-affinity" in decision.annotations["r1"].reason_pending


def test_preferred_anti_affinity_spreads_when_it_can_and_packs_when_it_must() -> None:
    serving = replace(running("live", gpu_count=1, limit=60), labels={"app": "llm-serve"})
    busy = worker("w0", profile="nvidia-a100x2", jobs=[serving])
    spread = decide([_replica("r1", 1, PREFER_APART)], [busy, worker("w1", "nvidia-a100x2")])
    assert spread.assigned() == {"r1": "w1"}
    alone = decide([_replica("r1", 1, PREFER_APART)], [busy])
    assert alone.assigned() == {"r1": "w0"}, "a preferred rule never blocks"
