"""Preemption (OJS ML §8.2): the SIGUSR2 flag, the Redis key, and yielding with `Preempted`."""

from __future__ import annotations

import logging
import os
import pickle
import time

import pytest
from celery.exceptions import Ignore

from celery_ojs_ml.checkpoint import (
    Checkpointer,
    Preempted,
    clear_preemption,
    flag_set,
    install_child_handler,
    preemption_request,
    preemption_requested,
    request_preemption,
    reset_flag,
)
from celery_ojs_ml.checkpoint.preempt import SIGNAL
from celery_ojs_ml.store.registry import OJSStore
from tests.checkpoint.conftest import Backend, FakeClock

JOB = "preempt-job"
_SIGNAL_DELIVERY_S = 5.0


def _raise_sigusr2_here() -> None:
    os.kill(os.getpid(), SIGNAL)
    deadline = time.monotonic() + _SIGNAL_DELIVERY_S
    while not flag_set() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_sigusr2_sets_the_flag_and_reset_clears_it() -> None:
    assert install_child_handler() is True
    assert flag_set() is False

    _raise_sigusr2_here()
    assert flag_set() is True

    reset_flag()
    assert flag_set() is False


def test_a_task_sees_a_sigusr2_preemption_through_its_checkpointer(
    file_backend: Backend, store: OJSStore
) -> None:
    install_child_handler()
    ckpt = Checkpointer(JOB, file_backend.settings(), store)
    assert ckpt.preempt_requested is False

    _raise_sigusr2_here()

    assert ckpt.preempt_requested is True


def test_a_task_sees_a_preemption_requested_through_redis(
    file_backend: Backend, store: OJSStore, clock: FakeClock
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(), store, clock=clock)
    assert ckpt.preempt_requested is False

    request_preemption(store, JOB, grace_s=30)
    clock.advance(0.5)

    assert ckpt.preempt_requested is True


def test_redis_is_polled_at_most_every_half_second(
    file_backend: Backend, store: OJSStore, clock: FakeClock
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(), store, clock=clock)
    assert ckpt.preempt_requested is False
    request_preemption(store, JOB, grace_s=30)

    clock.advance(0.49)
    assert ckpt.preempt_requested is False
    clock.advance(0.01)
    assert ckpt.preempt_requested is True


def test_the_redis_request_records_its_time_and_grace_and_expires_after_the_grace(
    store: OJSStore, clock: FakeClock
) -> None:
    request_preemption(store, JOB, grace_s=30, clock=clock)

    assert preemption_request(store, JOB) == {"requested_at": clock.now, "grace_s": 30}
    ttl_ms = store.client.pttl(store.key("preempt", JOB))
    assert 30_000 < ttl_ms <= 35_000
    clear_preemption(store, JOB)
    assert preemption_requested(store, JOB) is False


def test_a_negative_grace_period_is_refused_with_the_attribute_name(store: OJSStore) -> None:
    with pytest.raises(ValueError, match="ext_ml_preemption_grace_period_s"):
        request_preemption(store, JOB, grace_s=-1)


def test_yield_if_preempted_does_nothing_without_a_request(
    file_backend: Backend, store: OJSStore
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(), store)

    ckpt.yield_if_preempted()

    assert ckpt.preempt_requested is False


def test_yield_if_preempted_raises_preempted_an_ignore_naming_the_last_checkpoint(
    file_backend: Backend, store: OJSStore
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(on_preempt=True), store)
    request_preemption(store, JOB, grace_s=30)
    if ckpt.preempt_requested:
        ckpt.save(epoch=5, step=50)

    with pytest.raises(Preempted) as info:
        ckpt.yield_if_preempted()

    assert isinstance(info.value, Ignore)
    assert (info.value.task_id, info.value.epoch, info.value.sequence) == (JOB, 5, 1)
    assert str(info.value) == "preempt-job preempted after epoch 5; resumes from checkpoint 1"
    assert preemption_requested(store, JOB) is False


def test_yielding_without_the_checkpoint_on_preempt_asks_for_warns_section_8_2(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(on_preempt=True), store)
    ckpt.save(epoch=1)
    request_preemption(store, JOB, grace_s=30)

    with caplog.at_level(logging.WARNING), pytest.raises(Preempted):
        ckpt.yield_if_preempted()

    assert "yields to preemption without a checkpoint saved since the request" in caplog.text


def test_no_warning_when_the_job_does_not_promise_a_checkpoint_on_preempt(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(on_preempt=False), store)
    request_preemption(store, JOB, grace_s=30)

    with caplog.at_level(logging.WARNING), pytest.raises(Preempted) as info:
        ckpt.yield_if_preempted()

    assert caplog.text == ""
    assert str(info.value) == (
        "preempt-job preempted after an unknown epoch; resumes from no checkpoint"
    )


def test_preempted_survives_pickling_as_it_crosses_the_pool_boundary() -> None:
    copy = pickle.loads(pickle.dumps(Preempted("t-1", epoch=3, sequence=4)))

    assert (type(copy), copy.task_id, copy.epoch, copy.sequence) == (Preempted, "t-1", 3, 4)
