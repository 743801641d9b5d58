"""Queue GPU budgets, OJS ML §10.3: `max_total_gpus` and `max_concurrent_gpu_jobs`.

§10.3: a job over its queue's budget MUST wait (it is never rejected); the
budget counts what the queue holds fleet-wide (running and assigned jobs).
"""

from __future__ import annotations

from celery_ojs_ml.scheduler import Budget, schedule
from celery_ojs_ml.scheduler.budget import BudgetBook
from tests.scheduler.helpers import NOW, decide, job, running, worker

TRAIN2 = (("train", Budget(max_total_gpus=2)),)
BOTH = frozenset({"celery", "train"})
"""Workers here consume both queues."""


def test_a_job_over_its_queues_gpu_budget_waits_with_a_reason_naming_the_budget() -> None:
    """§10.3 MUST: wait, never reject; the reason names the queue and the limit."""
    fleet = [worker("w1", queues=BOTH, jobs=[running("r1", gpu_count=2, queue="train", limit=60)])]
    pending = [job("t1", at=1, gpu_count=1, queue="train")]
    decision = decide(pending, fleet, budgets=TRAIN2)
    assert decision.assignments == ()
    assert decision.denials == ()
    note = decision.annotations["t1"]
    assert note.reason_pending == ("queue 'train' budget: 2/2 GPUs in use (max_total_gpus)"), (
        note.reason_pending
    )


def test_assignments_of_one_pass_count_against_the_budget() -> None:
    pending = [job(f"t{i}", at=i, gpu_count=1, queue="train") for i in range(4)]
    decision = decide(pending, [worker("w1", queues=BOTH)], budgets=TRAIN2)
    assert [a.task_id for a in decision.assignments] == ["t0", "t1"]
    assert decision.annotations["t2"].reason_pending.startswith("queue 'train' budget: 2/2")


def test_jobs_of_other_queues_are_not_slowed_by_a_queue_over_budget() -> None:
    """The blocked job holds no reservation: a later job of another queue takes the GPUs."""
    fleet = [worker("w1", queues=BOTH, jobs=[running("r1", gpu_count=2, queue="train", limit=60)])]
    pending = [
        job("big-train", at=1, gpu_count=4, queue="train"),
        job("other", at=2, gpu_count=6, queue="celery"),
    ]
    decision = decide(pending, fleet, budgets=TRAIN2)
    assert [a.task_id for a in decision.assignments] == ["other"]
    assert decision.reservations == ()


def test_a_smaller_job_of_the_same_queue_that_fits_the_budget_still_starts() -> None:
    fleet = [worker("w1", queues=BOTH, jobs=[running("r1", gpu_count=1, queue="train", limit=60)])]
    pending = [
        job("two", at=1, gpu_count=2, queue="train"),
        job("one", at=2, gpu_count=1, queue="train"),
    ]
    decision = decide(pending, fleet, budgets=TRAIN2)
    assert [a.task_id for a in decision.assignments] == ["one"]
    assert decision.annotations["two"].reason_pending == (
        "queue 'train' budget: 1/2 GPUs in use (max_total_gpus); the job needs 2"
    )


def test_max_concurrent_gpu_jobs_limits_the_number_of_gpu_jobs_of_a_queue() -> None:
    budgets = (("train", Budget(max_concurrent_gpu_jobs=1)),)
    pending = [job(f"t{i}", at=i, gpu_count=1, queue="train") for i in range(3)]
    decision = decide(pending, [worker("w1", queues=BOTH)], budgets=budgets)
    assert [a.task_id for a in decision.assignments] == ["t0"]
    assert decision.annotations["t1"].reason_pending == (
        "queue 'train' budget: 1/1 GPU jobs running (max_concurrent_gpu_jobs)"
    )


def test_assigned_jobs_not_yet_running_count_against_the_budget() -> None:
    """A new leader counts what the old one assigned (passed in as `inflight`)."""
    pending = [job("t1", at=1, gpu_count=1, queue="train")]
    from celery_ojs_ml.scheduler import Policy

    decision = schedule(
        pending, [worker("w1", queues=BOTH)], NOW, Policy(budgets=TRAIN2), inflight=[("train", 2)]
    )
    assert decision.assignments == ()


def test_a_job_over_budget_preempts_nothing() -> None:
    fleet = [
        worker(
            "w1",
            profile="nvidia-a100x2",
            queues=BOTH,
            jobs=[
                running("r1", gpu_count=2, queue="train", limit=60),
            ],
        )
    ]
    spot = running("s1", gpu_count=2, priority_class="spot", started=NOW - 3600)
    fleet.append(worker("w2", profile="nvidia-a100x2", queues=BOTH, jobs=[spot]))
    pending = [job("t1", at=1, gpu_count=1, queue="train", priority_class="reserved")]
    decision = decide(pending, fleet, budgets=TRAIN2)
    assert decision.preemptions == ()


def test_the_budget_report_gives_each_queues_use_and_limits() -> None:
    book = BudgetBook(dict(TRAIN2), [("train", 1), ("celery", 4), ("train", 0)])
    book.take("train", 1)
    assert book.report() == {
        "train": {"gpus": 2, "max_total_gpus": 2, "jobs": 2, "max_concurrent_gpu_jobs": None}
    }
    assert decide([], [worker("w1", queues=BOTH)], budgets=TRAIN2).budgets == {
        "train": {"gpus": 0, "max_total_gpus": 2, "jobs": 0, "max_concurrent_gpu_jobs": None}
    }


def test_a_job_that_ended_while_its_lease_lingers_holds_none_of_its_queues_budget() -> None:
    """`RunningJob.ended`: the worker's heartbeat no longer shows it; its lease's release
    is written with the next batch. The GPUs it held are free in the heartbeat, and its
    queue's budget is too."""
    gone = running("r1", gpu_count=2, queue="train", limit=60, ended=True)
    fleet = [worker("w1", queues=BOTH, jobs=[gone])]
    decision = decide([job("t1", at=1, gpu_count=1, queue="train")], fleet, budgets=TRAIN2)
    assert [a.task_id for a in decision.assignments] == ["t1"]
