"""The overhead benchmarks' statistics (benchmarks/variant_servers.py): the order variants are
measured in and the interval their paired ratios are reported with. A wrong interval would turn
noise into a claim, so its coverage is checked by simulation."""

from __future__ import annotations

import math
import random
import sys
from collections import Counter

import pytest
from support.paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from variant_servers import chosen, median_interval, rotation


def test_median_interval_matches_the_binomial_table():
    # Tables of the distribution-free 95 % interval give ranks 10 and 21 (1-based) for n = 30.
    median, low, high = median_interval(float(i) for i in range(30))
    assert (median, low, high) == (14.5, 9.0, 20.0)
    assert median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)  # too few for 95 %: min and max


@pytest.mark.parametrize("n", [8, 30, 61])
def test_median_interval_covers_the_true_median_at_least_95_percent_of_the_time(n):
    rng = random.Random(n)
    true_median = math.log(2)  # of the exponential distribution: a skewed noise, like timings
    trials = 2000
    covered = 0
    for _ in range(trials):
        _, low, high = median_interval(rng.expovariate(1.0) for _ in range(n))
        covered += low <= true_median <= high
    assert covered / trials >= 0.94  # 95 % nominal (the discrete intervals hold a little more), less sampling noise


def test_rotation_puts_every_variant_in_every_position_equally_often():
    variants = ["bare", "floor", "ace", "otel"]
    positions = Counter(
        (variant, position) for turn in range(8) for position, variant in enumerate(rotation(variants, turn))
    )
    assert set(positions.values()) == {2}
    assert len(positions) == 16


def test_chosen_keeps_the_base_first_and_each_variant_once():
    assert chosen(("bare", "floor", "ace"), None) == ("bare", "floor", "ace")
    assert chosen(("bare", "floor", "ace"), ["ace", "bare", "ace"]) == ("bare", "ace")
