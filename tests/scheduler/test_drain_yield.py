"""A preemptible spot job holds no drain (docs/scheduling.md, "Placement score"): with
preemption on, a large job of a higher band preempts it rather than waits for it, so a
worker's drain time leaves it out, and a spot job's own start delays no drain. Long jobs
that cannot be preempted then gather where such jobs already hold the drain, and the large
workers left hold only work a large job may preempt."""

from __future__ import annotations

from celery_ojs_ml.scheduler import Policy, WorkerState
from celery_ojs_ml.scheduler.order import Ask
from celery_ojs_ml.scheduler.slot import Slot
from celery_ojs_ml.scheduler.timefit import holds_drain
from tests.scheduler.helpers import NOW, decide, job, running, worker

HOUR = 3600.0
DAY = 24 * HOUR


def _slot(state: WorkerState, preemption: bool = True) -> Slot:
    return Slot(0, state, NOW, Policy(preemption=preemption))


def _large(name: str, band: str, hours: float) -> WorkerState:
    """An 8-GPU worker running one 1-GPU `band` job that ends in `hours`."""
    busy = running(f"{name}-job", limit=600 + hours * HOUR, gpu_count=1, priority_class=band)
    return worker(name, "nvidia-a100x8", [busy])


def test_a_running_preemptible_spot_job_is_left_out_of_the_drain_time() -> None:
    spot = running("spot", limit=DAY, gpu_count=1, priority_class="spot")
    short = running("short", limit=1200, gpu_count=1, priority_class="reserved")
    assert spot.yields_drain and not short.yields_drain
    state = worker("w", "nvidia-a100x8", [spot, short])
    assert _slot(state).drain_at() == NOW + 600  # the reserved job's end
    assert _slot(state, preemption=False).drain_at() == NOW - 600 + DAY


def test_a_spot_job_that_may_not_be_preempted_holds_the_drain() -> None:
    never = running(
        "never", limit=DAY, gpu_count=1, priority_class="spot", preemption_policy="never"
    )
    pinned = running("pinned", limit=DAY, gpu_count=1, priority_class="spot", preemptible=False)
    for r in (never, pinned):
        assert not r.yields_drain
        assert _slot(worker("w", "nvidia-a100x8", [r])).drain_at() == NOW - 600 + DAY


def test_a_long_reserved_job_joins_the_worker_already_held_by_one() -> None:
    """Both workers stay busy a day; only `w-held`'s job cannot be preempted. Before, the
    first in fleet order took the long job and both large workers ended up held."""
    fleet = [_large("w-spot", "spot", 30), _large("w-held", "reserved", 30)]
    long = job("long", at=NOW - 60, limit=20 * HOUR, gpu_count=1, priority_class="reserved")
    assert [a.worker for a in decide([long], fleet).assignments] == ["w-held"]
    assert [a.worker for a in decide([long], fleet, preemption=False).assignments] == ["w-spot"]


def test_a_spot_job_delays_no_drain_and_is_never_deferred() -> None:
    """A long spot job takes the place by score, first in order; a reserved one in its
    place is deferred so the short job behind it starts there."""
    spot = job("long", at=NOW - 60, limit=DAY, gpu_count=1, priority_class="spot")
    reserved = job("long", at=NOW - 60, limit=DAY, gpu_count=1, priority_class="reserved")
    short = job("short", at=NOW - 30, limit=HOUR / 2, gpu_count=1, priority_class="spot")
    busy = [running(f"r{i}", limit=1200, gpu_count=1, priority_class="reserved") for i in range(7)]
    fleet = [worker("w-large", "nvidia-a100x8", busy)]
    assert [a.task_id for a in decide([spot, short], fleet).assignments] == ["long"]
    assert [a.task_id for a in decide([reserved, short], fleet).assignments] == ["short"]
    assert holds_drain(Ask.of(reserved, NOW), Policy())
    assert not holds_drain(Ask.of(spot, NOW), Policy())
    assert holds_drain(Ask.of(spot, NOW), Policy(preemption=False))


def test_a_job_above_spot_is_reserved_where_it_will_start_by_preemption() -> None:
    """`w-spot` runs seven day-long spot jobs beside a reserved one ending in 1 h;
    `w-busy` runs reserved jobs ending in 5 h. An 8-GPU reserved job is reserved on
    `w-spot` from the hour, when it may preempt the spot jobs, plus the grace period,
    not on `w-busy` at 5 h behind work it would not wait for."""
    spot = [running(f"s{i}", limit=DAY, gpu_count=1, priority_class="spot") for i in range(7)]
    hour = running("hour", limit=600 + HOUR, gpu_count=1, priority_class="reserved")
    busy = [
        running(f"b{i}", limit=600 + 5 * HOUR, gpu_count=1, priority_class="reserved")
        for i in range(8)
    ]
    fleet = [worker("w-spot", "nvidia-a100x8", [*spot, hour]), worker("w-busy", jobs=busy)]
    big = job("big", at=NOW - 60, limit=HOUR, gpu_count=8, priority_class="reserved")
    (held,) = decide([big], fleet).reservations
    assert (held.worker, held.start) == ("w-spot", NOW + HOUR + Policy().preemption_grace_s)
    (held,) = decide([big], fleet, preemption=False).reservations
    assert (held.worker, held.start) == ("w-busy", NOW + 5 * HOUR)
