"""The estimator keeps each worker's heap key (when a footprint stays free there for ever)
per worker version and footprint, so kinds of job with equal needs share it, and a worker
that changed is keyed afresh."""

from __future__ import annotations

from celery_ojs_ml.scheduler.estimate import SCAN_LIMIT, Estimator
from celery_ojs_ml.scheduler.fleet import FleetView
from celery_ojs_ml.scheduler.model import Policy
from celery_ojs_ml.scheduler.order import Ask
from celery_ojs_ml.scheduler.score import Workload
from tests.scheduler.helpers import NOW, job, worker


def test_a_worker_filled_since_its_key_was_kept_is_keyed_again() -> None:
    n = SCAN_LIMIT + 2
    view = FleetView([worker(f"w{i:02d}") for i in range(n)], NOW, Policy(), Workload())
    estimator = Estimator(view)
    small = Ask.of(job("small", gpu_count=2), NOW)
    assert estimator.soonest(small) == (NOW, view.slots[0])  # every key kept: now
    for slot in view.slots[:-1]:  # every worker but the last runs an 8-GPU job for ever
        view.assign(Ask.of(job(f"big-{slot.name}", gpu_count=8), NOW), slot)
    assert estimator.soonest(small) == (NOW, view.slots[-1])


def test_kinds_of_job_with_equal_needs_share_a_key_and_others_do_not() -> None:
    view = FleetView([worker("w", "nvidia-a100x8")], NOW, Policy(), Workload())
    estimator = Estimator(view)
    one, other = (
        Ask.of(job("a", gpu_count=1), NOW),
        Ask.of(job("b", gpu_count=1, precision="bf16"), NOW),
    )
    assert one.job.class_key != other.job.class_key and one.want == other.want
    view.assign(Ask.of(job("c", gpu_count=8, limit=600), NOW), view.slots[0])
    assert estimator.soonest(one) == (NOW + 600, view.slots[0])
    assert estimator.soonest(other) == (NOW + 600, view.slots[0])
    dedicated = Ask.of(job("d", gpu_count=1, gpu_affinity="dedicated"), NOW)
    assert estimator.soonest(dedicated) == (NOW + 600, view.slots[0])


def test_jobs_of_one_footprint_in_queues_served_alike_share_one_heap() -> None:
    """One heap per (footprint, eligible workers): a class queued under many names that
    the same workers serve is keyed over the fleet once, not once per queue; a queue
    served by other workers gets its own."""
    both = frozenset({"q1", "q2"})
    fleet = [worker("w0", queues=both), worker("w1", queues=both),
             worker("w2", queues=frozenset({"q3"}))]  # fmt: skip
    view = FleetView(fleet, NOW, Policy(), Workload())
    estimator = Estimator(view)
    view.assign(Ask.of(job("c", gpu_count=8, limit=600, queue="q1"), NOW), view.slots[0])
    view.assign(Ask.of(job("d", gpu_count=8, limit=300, queue="q3"), NOW), view.slots[2])
    first = estimator.soonest(Ask.of(job("a", gpu_count=8, queue="q1"), NOW))
    second = estimator.soonest(Ask.of(job("b", gpu_count=8, queue="q2"), NOW))
    assert first == second == (NOW, view.slots[1])
    view.assign(Ask.of(job("e", gpu_count=8, limit=900, queue="q2"), NOW), view.slots[1])
    assert estimator.soonest(Ask.of(job("f", gpu_count=8, queue="q2"), NOW)) == (
        NOW + 600,
        view.slots[0],
    )
    other = estimator.soonest(Ask.of(job("g", gpu_count=8, queue="q3"), NOW))
    assert other == (NOW + 300, view.slots[2])
    assert len(estimator._heaps) == 2
