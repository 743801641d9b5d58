"""Tests for `celery_ojs_ml.allocator.devices`: best-fit choice of GPU indices."""

from __future__ import annotations

import pytest

from celery_ojs_ml.allocator import free_runs, pick_devices


@pytest.mark.parametrize(
    ("free", "runs"),
    [
        pytest.param([], [], id="no free device has no runs"),
        pytest.param([3, 0, 1], [[0, 1], [3]], id="indices are sorted before grouping"),
        pytest.param([0, 2, 4], [[0], [2], [4]], id="gaps split runs"),
    ],
)
def test_free_runs_group_consecutive_indices(free: list[int], runs: list[list[int]]) -> None:
    assert free_runs(free) == runs


@pytest.mark.parametrize(
    ("free", "count", "devices"),
    [
        pytest.param([0, 1, 2, 3], 0, (), id="a job asking for 0 GPUs gets no devices"),
        pytest.param([0, 1, 2, 3], 2, (0, 1), id="on an idle worker the lowest indices"),
        pytest.param([0, 1, 3], 1, (3,), id="one GPU takes the isolated device, sparing the pair"),
        pytest.param([0, 2, 3, 4, 5, 7], 2, (2, 3), id="two GPUs take a run of four"),
        pytest.param([0, 1, 4, 5, 6], 2, (0, 1), id="an exact run wins over a longer one"),
        pytest.param([0, 2, 3, 5], 2, (2, 3), id="the smallest fitting run, lowest start"),
        pytest.param([0, 2, 4, 6], 3, (0, 2, 4), id="no run fits: the lowest free indices"),
    ],
)
def test_devices_are_chosen_by_best_fit(
    free: list[int], count: int, devices: tuple[int, ...]
) -> None:
    assert pick_devices(free, count) == devices


def test_asking_for_more_devices_than_are_free_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 devices requested but only 2 free"):
        pick_devices([0, 1], 3)
