"""The celery/billiard/kombu internals `celery_ojs_ml.celery_internals` reads (checked against
celery 5.7.0, billiard 4.3.2, kombu 5.x). Each test fails when one of them changes."""

from __future__ import annotations

import inspect

import billiard.pool
from celery.concurrency import asynpool
from kombu.asynchronous import Hub

from celery_ojs_ml import celery_internals
from celery_ojs_ml.wire import warm_slots


def test_warm_pool_finds_every_internal_it_needs_on_the_asynpool_class() -> None:
    assert celery_internals.missing_internals() == []


def test_asynpool_keeps_the_attributes_the_router_reads() -> None:
    init = inspect.getsource(asynpool.AsynPool.__init__)
    for name in celery_internals.POOL_ATTRIBUTES:
        assert f"self.{name}" in init, name


def test_the_write_scheduler_is_the_hubs_consolidate_callback_popping_the_outbound_front() -> None:
    src = inspect.getsource(asynpool.AsynPool._create_write_handlers)
    assert "hub.consolidate_callback = schedule_writes" in src
    assert "pop_message = outbound.popleft" in src
    assert "def schedule_writes(ready_fds" in src


def test_the_hub_reads_the_consolidate_callback_when_its_loop_is_created() -> None:
    """So the router must wrap it in `register_with_event_loop`, before the loop starts."""
    assert "consolidate_callback = self.consolidate_callback" in inspect.getsource(Hub.create_loop)


def test_billiard_gives_each_pool_process_an_index_before_it_starts() -> None:
    src = inspect.getsource(billiard.pool.Pool._create_worker_process)
    assert src.index("w.index = i") < src.index("w.start()")


def test_a_device_mask_round_trips_and_marks_bound() -> None:
    mask = warm_slots.mask_of([0, 3])
    assert warm_slots.devices_of_mask(mask) == [0, 3] and mask > 0
    assert warm_slots.mask_of([]) != 0  # bound to nothing is still bound


def test_the_fair_write_scheduler_skips_busy_children_and_marks_a_written_one_busy() -> None:
    """`write_behind` takes a child out of `_busy_workers` for the write of a follower."""
    src = inspect.getsource(asynpool.AsynPool._create_write_handlers)
    assert "if is_fair_strategy and ready_fd in busy_workers:" in src
    assert "mark_worker_as_busy(ready_fd)" in src
    assert "if ready_fd in active_writes:" in src


def test_billiard_puts_back_a_job_written_to_a_child_that_exits_before_accepting_it() -> None:
    """A follower in the pipe of a child that dies runs elsewhere (`write_behind`)."""
    down = inspect.getsource(asynpool.AsynPool.on_job_process_down)
    assert "self.on_partial_read(job, job._write_to)" in down
    partial = inspect.getsource(asynpool.AsynPool.on_partial_read)
    assert "if not job._accepted:" in partial and "self._put_back(job)" in partial


def test_the_pool_semaphore_admits_requests_and_its_extra_releases_are_capped() -> None:
    """`to_pool_now` goes past `_process_task_sem`; the lax bound absorbs the release."""
    from celery.worker.worker import WorkController
    from kombu.asynchronous.semaphore import LaxBoundedSemaphore

    assert "self._quick_acquire(self._process_task, req)" in inspect.getsource(
        WorkController._process_task_sem
    )
    assert "req.execute_using_pool(self.pool)" in inspect.getsource(WorkController._process_task)
    sem = LaxBoundedSemaphore(2)
    sem.release()
    assert sem.value == 2
