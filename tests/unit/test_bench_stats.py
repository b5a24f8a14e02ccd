"""Paired bootstrap intervals (bench/stats.py): exactness without noise, coverage under round-level load bursts."""

from __future__ import annotations

import numpy as np
import pytest

from draftline.bench.stats import percentile_ratio, throughput_ratio


def simulate(rng, true_speedup, rounds=3, prompts=24, burst=0.3, jitter=0.05):
    """Per-request latencies: prompt difficulty, a load burst per round that slows both engines (paired), jitter."""
    difficulty = rng.uniform(0.5, 1.5, prompts)[None]
    load = 1 + burst * rng.random((rounds, 1))
    base = difficulty * load * rng.normal(1, jitter, (rounds, prompts))
    cand = difficulty * load * rng.normal(1, jitter, (rounds, prompts)) / true_speedup
    tokens = np.full((rounds, prompts), 48.0)
    return tokens, cand, tokens, base


def test_no_noise_gives_the_exact_ratio_and_a_zero_width_interval():
    tokens = np.full((3, 5), 10.0)
    seconds = np.arange(1.0, 16.0).reshape(3, 5)
    interval = throughput_ratio(tokens, seconds / 2, tokens, seconds, 0.95, 500)
    assert interval.estimate == pytest.approx(2.0) and interval.low == pytest.approx(2.0) and interval.high == pytest.approx(2.0)


def test_tokens_weigh_in():
    seconds = np.ones((2, 4))
    interval = throughput_ratio(np.full((2, 4), 30.0), seconds, np.full((2, 4), 10.0), seconds, 0.95, 200)
    assert interval.estimate == pytest.approx(3.0)


def test_interval_covers_the_true_speedup_about_as_often_as_it_claims():
    rng = np.random.default_rng(0)
    trials, covered, widths = 60, 0, []
    for _ in range(trials):
        interval = throughput_ratio(*simulate(rng, 1.4), 0.9, 400, seed=int(rng.integers(1 << 30)))
        covered += interval.low <= 1.4 <= interval.high
        widths.append(interval.high - interval.low)
    assert covered / trials >= 0.8, f"90% intervals covered the truth in only {covered}/{trials} trials"
    # pairing: the per-round load bursts (up to 30%) cancel, so the interval is far narrower than the bursts
    assert np.median(widths) < 0.1


def test_more_rounds_narrow_the_interval():
    rng = np.random.default_rng(1)
    few = throughput_ratio(*simulate(rng, 1.2, rounds=2, jitter=0.2), 0.95, 500)
    many = throughput_ratio(*simulate(rng, 1.2, rounds=12, jitter=0.2), 0.95, 500)
    assert many.high - many.low < few.high - few.low


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="same \\[rounds, prompts\\] cells"):
        throughput_ratio(np.ones((2, 3)), np.ones((2, 3)), np.ones((3, 3)), np.ones((3, 3)), 0.95, 100)


def test_percentile_ratio_of_scaled_gaps():
    rng = np.random.default_rng(2)
    gaps = [[list(rng.exponential(0.01, 30)) for _ in range(6)] for _ in range(3)]
    doubled = [[[2 * g for g in per_prompt] for per_prompt in per_round] for per_round in gaps]
    interval = percentile_ratio(doubled, gaps, 99, 0.95, 300)
    assert interval.estimate == pytest.approx(2.0) and interval.low == pytest.approx(2.0) and interval.high == pytest.approx(2.0)
    slower = [[list(rng.exponential(0.03, 30)) for _ in range(6)] for _ in range(3)]
    interval = percentile_ratio(slower, gaps, 99, 0.95, 300)
    assert interval.low > 1.5 and interval.low <= interval.estimate <= interval.high
    assert percentile_ratio([[[]]], [[[0.1]]], 99, 0.95, 100) is None
