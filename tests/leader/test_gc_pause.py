"""The leader pauses the cyclic garbage collector for a pass and restores it after."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from celery_ojs_ml.leader.gc_pause import gc_paused


@pytest.fixture
def collector_on() -> Iterator[None]:
    was_on = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was_on else gc.disable)()


def test_the_collector_is_off_during_a_pass_and_on_after(collector_on: None) -> None:
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_is_on_again_after_a_pass_that_raised(collector_on: None) -> None:
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a pass failed")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off(collector_on: None) -> None:
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()
