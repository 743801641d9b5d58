"""Warm children: the warm pool moves a job that waits for a pool child onto
the devices an idle child is bound to, or exchanges devices with a job no child has
taken yet. The allocator keeps capacity and the job's constraints while it does."""

from __future__ import annotations

from celery_ojs_ml.testing.builders import worker_with
from tests.allocator.helpers import allocator, job, run
from tests.allocator.test_nvlink import PAIRS

ONE = job(gpu_count=1)


def test_two_jobs_of_the_same_count_exchange_their_devices() -> None:
    a = allocator()
    assert run(a, "first", ONE).devices == (0,)
    assert run(a, "later", ONE).devices == (1,)
    swapped = a.swap("first", "later")
    assert swapped is not None
    assert [x.devices for x in swapped] == [(1,), (0,)]
    assert run(a, "next", ONE).devices == (2,), "the exchange freed nothing and took nothing"
    assert a.free("first").devices == (1,)  # type: ignore[union-attr]
    assert run(a, "last", ONE).devices == (1,)


def test_jobs_of_different_counts_do_not_exchange_devices() -> None:
    a = allocator()
    run(a, "one", ONE)
    run(a, "two", job(gpu_count=2))
    assert a.swap("one", "two") is None
    assert a.swap("one", "one") is None
    assert a.swap("one", "unknown") is None


def test_a_job_on_nvlink_peers_is_only_moved_or_exchanged_onto_peers() -> None:
    a = allocator(worker_with(gpus=4, interconnect="nvlink"), nvlink_peers=PAIRS)
    linked = run(a, "linked", job(gpu_count=2, gpu_interconnect="nvlink"))
    assert linked.devices == (0, 1)
    assert a.move("linked", (1, 2)) is None, "1 and 2 are not bridged"
    assert a.move("linked", (2, 3)) is not None
    plain = run(a, "plain", job(gpu_count=2))
    assert plain.devices == (0, 1)
    assert a.swap("linked", "plain") is not None, "both sets are bridged pairs"
    assert a.free("linked").devices == (0, 1)  # type: ignore[union-attr]
