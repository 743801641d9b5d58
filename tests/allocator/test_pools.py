"""Dynamic reservations inside one worker's gate (OJS ML §8.3).

§8.3: a job naming a reservation MUST NOT run outside the reserved capacity,
and no other job uses that capacity while the reservation is held.
"""

from __future__ import annotations

from celery_ojs_ml.allocator import Allocation, Demand, Denied, Pending
from tests.allocator.helpers import allocator, job, run


def test_jobs_outside_a_held_reservation_never_get_its_gpus() -> None:
    """§8.3: with 2 of 4 GPUs reserved, a third outside GPU job waits."""
    a = allocator()
    a.set_pools({"r1": Demand(gpus=2)})
    run(a, "o1", job(gpu_count=1))
    run(a, "o2", job(gpu_count=1))
    third = a.try_alloc("o3", "o3", job(gpu_count=1))
    assert isinstance(third, Pending), third
    assert a.free_capacity().gpus == 0


def test_a_job_of_the_reservation_starts_at_once_inside_it_while_the_rest_is_full() -> None:
    a = allocator()
    a.set_pools({"r1": Demand(gpus=2)})
    run(a, "o1", job(gpu_count=1))
    run(a, "o2", job(gpu_count=1))
    inside = run(a, "in1", job(gpu_count=2, reservation_id="r1"))
    outside = {d for k in ("o1", "o2") for d in _devices(a, k)}
    assert len(inside.devices) == 2 and not set(inside.devices) & outside


def test_a_job_of_the_reservation_never_takes_more_than_the_reservation_holds() -> None:
    """§8.3: the job fits only what is left of its own reservation, however free the rest."""
    a = allocator()
    a.set_pools({"r1": Demand(gpus=2)})
    run(a, "in1", job(gpu_count=1, reservation_id="r1"))
    run(a, "in2", job(gpu_count=1, reservation_id="r1"))
    third = a.try_alloc("in3", "in3", job(gpu_count=1, reservation_id="r1"))
    assert isinstance(third, Pending), third
    bigger = a.try_alloc("big", "big", job(gpu_count=3, reservation_id="r1"))
    assert isinstance(bigger, Denied), bigger  # more than the reservation: never
    assert a.free_capacity().gpus == 2  # the outside half is untouched


def test_a_job_naming_a_reservation_this_worker_does_not_hold_is_denied() -> None:
    a = allocator()
    out = a.try_alloc("x", "x", job(gpu_count=1, reservation_id="elsewhere"))
    assert isinstance(out, Denied) and "reservation_id" in out.reason, out


def test_ending_a_reservation_gives_its_unused_capacity_back_and_keeps_jobs_inside_counted() -> (
    None
):
    a = allocator()
    a.set_pools({"r1": Demand(gpus=2)})
    run(a, "in1", job(gpu_count=1, reservation_id="r1"))
    assert a.free_capacity().gpus == 2
    a.set_pools({})
    assert a.free_capacity().gpus == 3  # in1 still runs and still counts
    a.free("in1")
    assert a.free_capacity().gpus == 4


def test_the_snapshot_lists_held_reservations() -> None:
    a = allocator()
    a.set_pools({"r1": Demand(gpus=2, cpu_cores=4)})
    snap = a.snapshot()
    held = {"gpu_count": 2, "cpu_cores": 4, "memory_gb": 0, "tpu_chip_count": 0}
    assert snap["reservations"] == {"r1": held}
    assert snap["free"]["gpu_count"] == 2


def _devices(a: object, key: str) -> tuple[int, ...]:
    for alloc in a.allocations():  # type: ignore[attr-defined]
        if isinstance(alloc, Allocation) and alloc.key == key:
            return alloc.devices
    raise AssertionError(key)


def test_a_job_of_the_reservation_starts_at_once_though_jobs_outside_it_are_held_ahead() -> None:
    """§8.3: outside jobs held for the full rest of the worker cannot use the reservation,
    so they never hold back a job inside it (the backfill rule sets aside only what the
    requests ahead could take)."""
    a = allocator()
    a.set_pools({"r1": Demand(gpus=2)})
    run(a, "o1", job(gpu_count=1))
    run(a, "o2", job(gpu_count=1))
    for name in ("o3", "o4"):
        held = a.try_alloc(name, name, job(gpu_count=1))
        assert isinstance(held, Pending), held
        a.hold(held)
    inside = a.try_alloc("in1", "in1", job(gpu_count=2, reservation_id="r1"))
    assert isinstance(inside, Allocation), inside
    assert a.pump() == []  # the outside jobs still wait for the outside GPUs


def test_a_job_outside_the_reservation_is_not_held_back_by_jobs_waiting_inside_it() -> None:
    a = allocator()
    a.set_pools({"r1": Demand(gpus=2)})
    run(a, "in1", job(gpu_count=2, reservation_id="r1"))
    held = a.try_alloc("in2", "in2", job(gpu_count=1, reservation_id="r1"))
    assert isinstance(held, Pending), held
    a.hold(held)
    outside = a.try_alloc("o1", "o1", job(gpu_count=2))
    assert isinstance(outside, Allocation), outside


def test_jobs_of_one_reservation_still_keep_their_order_inside_it() -> None:
    a = allocator()
    a.set_pools({"r1": Demand(gpus=2)})
    run(a, "in1", job(gpu_count=1, reservation_id="r1"))
    big = a.try_alloc("in2", "in2", job(gpu_count=2, reservation_id="r1"))
    assert isinstance(big, Pending), big
    a.hold(big)
    small = a.try_alloc("in3", "in3", job(gpu_count=1, reservation_id="r1"))
    assert isinstance(small, Pending) and "behind held in2" in small.reason, small
