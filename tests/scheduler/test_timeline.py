"""A worker's free capacity over time: levels, backfill windows and earliest starts."""

from __future__ import annotations

import math

from celery_ojs_ml.scheduler.timeline import Timeline

ONE = (1.0, 0.0, 0.0, 0.0, 0.0)
FOUR = (4.0, 0.0, 0.0, 0.0, 0.0)


def _busy() -> Timeline:
    """0 GPUs free now; one frees at 10, three more at 20; 4 held from 30 to 50."""
    tl = Timeline(0.0, (0.0, 8.0, 64.0, 0.0, 0.0))
    tl.add(10, ONE)
    tl.add(20, (3.0, 0.0, 0.0, 0.0, 0.0))
    tl.hold(30, 50, FOUR)
    return tl


def test_a_job_that_must_run_for_ever_starts_once_its_gpus_stay_free() -> None:
    assert _busy().earliest(ONE) == 50
    assert _busy().earliest(FOUR) == 50


def test_a_short_job_fits_the_gap_before_a_reservation() -> None:
    assert _busy().earliest(ONE, 20) == 10
    assert _busy().earliest(FOUR, 10) == 20
    assert _busy().earliest(FOUR, 11) == 50


def test_what_is_never_free_has_no_start() -> None:
    tl = Timeline(0.0, (0.0, 8.0, 64.0, 0.0, 0.0))
    assert tl.earliest(ONE) == math.inf
    assert tl.first_fit(ONE) == math.inf


def test_the_lowest_level_over_a_window_sees_a_later_reservation() -> None:
    tl = _busy()
    assert tl.lowest_between(20, 30)[0] == 4
    assert tl.lowest_between(20, 31)[0] == 0
    assert tl.lowest_between(20, None)[0] == 0
    assert tl.lowest_between(50, None)[0] == 4


def test_shadow_holds_count_for_estimates_but_not_for_backfill() -> None:
    tl = _busy()
    tl.hold(50, None, FOUR, shadow=True)
    assert tl.earliest(ONE) == math.inf
    assert tl.earliest(ONE, shadow=False) == 50
    assert tl.lowest_between(50, None)[0] == 4


def test_changes_at_or_before_now_count_from_now() -> None:
    tl = Timeline(100.0, (0.0, 0.0, 0.0, 0.0, 0.0))
    tl.add(90, ONE)
    assert tl.first_fit(ONE) == 100
