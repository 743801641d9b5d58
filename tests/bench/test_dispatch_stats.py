"""`bench/dispatch.py`: the throughput verdict's pairing and its interval for the median."""

from __future__ import annotations

import math
import random
from typing import Any

from bench.dispatch import median_ci, paired_ratios


def _round(*rates: float) -> dict[str, Any]:
    return {"tasks_per_s_segments": list(rates)}


def test_segment_i_of_a_variant_is_paired_with_segment_i_of_plain_in_the_same_round() -> None:
    mine = [_round(80.0, 90.0), _round(40.0, 45.0)]
    plain = [_round(100.0, 100.0), _round(50.0, 60.0)]
    assert paired_ratios(mine, plain) == [0.8, 0.9, 0.8, 0.75]


def test_a_variant_with_fewer_segments_pairs_only_the_ones_it_ran() -> None:
    assert paired_ratios([_round(30.0)], [_round(60.0, 90.0, 120.0)]) == [0.5]


def test_the_interval_is_the_binomial_order_statistics_around_the_median() -> None:
    values = [float(i) for i in range(1, 25)]  # n = 24: k = 7, P(B < 7) = 0.0113 <= 0.025
    assert median_ci(values) == (7.0, 18.0)
    below = sum(math.comb(24, j) for j in range(7)) / 2**24
    assert below <= 0.025 < below + math.comb(24, 7) / 2**24


def test_the_interval_is_the_range_when_there_are_too_few_values() -> None:
    assert median_ci([0.9, 0.7, 0.8]) == (0.7, 0.9)
    assert median_ci([0.5]) == (0.5, 0.5)


def test_the_interval_covers_the_true_median_about_95_times_in_100() -> None:
    rng = random.Random(11)
    hits = 0
    for _ in range(2000):
        low, high = median_ci([rng.gauss(0.85, 0.1) for _ in range(24)])
        hits += low <= 0.85 <= high
    assert 0.95 <= hits / 2000 <= 0.995  # exact coverage for n = 24 is 0.977
