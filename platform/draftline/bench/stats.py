"""Confidence intervals for paired engine comparisons: a two-way (rounds x prompts) paired bootstrap.

Every engine runs every prompt in every round, so a comparison has one cell per (round, prompt) for each side.
A bootstrap sample draws rounds and prompts independently with replacement (the two-way "pigeonhole" bootstrap:
both are random effects: rounds carry the machine's load at that moment, prompts carry content) and weights each
cell by (times its round was drawn) x (times its prompt was drawn). The same weights apply to both sides, which
keeps the pairing: a burst of load in one round slows both engines in that round and cancels in the ratio.
The interval is the percentile interval of the statistic over the bootstrap samples.

Throughput from per-request cells. For a closed loop with c requests in flight, Little's law gives
wall time ~= sum(request latency) / c, so (sum of output tokens) / (sum of latencies) is proportional to the
load's tokens/s with the same factor for both engines at the same concurrency: the ratio of the two is the
speedup, and it decomposes into cells that can be resampled (a whole load's wall time cannot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    confidence: float

    def as_dict(self) -> dict:
        return {"estimate": round(self.estimate, 4), "low": round(self.low, 4), "high": round(self.high, 4),
                "confidence": self.confidence}  # fmt: skip


def bootstrap_weights(num_rounds: int, num_prompts: int, samples: int, seed: int) -> np.ndarray:
    """[samples, rounds, prompts] cell weights: (draws of the round) x (draws of the prompt)."""
    rng = np.random.default_rng(seed)
    round_counts = rng.multinomial(num_rounds, np.full(num_rounds, 1 / num_rounds), size=samples)
    prompt_counts = rng.multinomial(num_prompts, np.full(num_prompts, 1 / num_prompts), size=samples)
    return (round_counts[:, :, None] * prompt_counts[:, None, :]).astype(np.float64)


def _interval(estimate: float, samples: np.ndarray, confidence: float) -> Interval:
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return Interval(float(estimate), float(low), float(high), confidence)


def throughput_ratio(
    tokens_a: np.ndarray, seconds_a: np.ndarray, tokens_b: np.ndarray, seconds_b: np.ndarray,
    confidence: float, samples: int, seed: int = 0,
) -> Interval:  # fmt: skip
    """(sum tokens_a / sum seconds_a) / (sum tokens_b / sum seconds_b), cells [rounds, prompts], with its interval."""
    cells = [np.asarray(x, dtype=np.float64) for x in (tokens_a, seconds_a, tokens_b, seconds_b)]
    shape = cells[0].shape
    if any(c.shape != shape for c in cells) or len(shape) != 2:
        raise ValueError(f"throughput_ratio: every side needs the same [rounds, prompts] cells, got {[c.shape for c in cells]}")

    def ratio(weights: np.ndarray) -> np.ndarray:
        ta, sa, tb, sb = (np.einsum("...rp,rp->...", weights, c) for c in cells)
        return (ta / sa) / (tb / sb)

    estimate = float(ratio(np.ones(shape)))
    return _interval(estimate, ratio(bootstrap_weights(*shape, samples, seed)), confidence)


def _weighted_percentile(values: np.ndarray, weights: np.ndarray, pct: float) -> np.ndarray:
    """Percentile of `values` [N] under each row of `weights` [S, N] (inverse of the weighted CDF)."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[:, order], axis=1)
    targets = cumulative[:, -1:] * pct / 100
    index = np.minimum((cumulative < targets).sum(axis=1), len(values) - 1)
    return values[order][index]


def percentile_ratio(
    gaps_a: list[list[list[float]]], gaps_b: list[list[list[float]]], pct: float,
    confidence: float, samples: int, seed: int = 0,
) -> Optional[Interval]:  # fmt: skip
    """pct-th percentile of side a's gaps / side b's; gaps[round][prompt] is a list of seconds. None if a side has none."""
    num_rounds, num_prompts = len(gaps_a), len(gaps_a[0])
    weights = bootstrap_weights(num_rounds, num_prompts, samples, seed).reshape(samples, -1)
    ones = np.ones((1, num_rounds * num_prompts))

    def percentile_of(gaps, cell_weights):
        values = np.array([g for per_round in gaps for per_prompt in per_round for g in per_prompt], dtype=np.float64)
        if values.size == 0:
            return None
        counts = [len(per_prompt) for per_round in gaps for per_prompt in per_round]
        return _weighted_percentile(values, np.repeat(cell_weights, counts, axis=1), pct)

    point_a, point_b = percentile_of(gaps_a, ones), percentile_of(gaps_b, ones)
    if point_a is None or point_b is None:
        return None
    boot = percentile_of(gaps_a, weights) / np.maximum(percentile_of(gaps_b, weights), 1e-12)
    return _interval(float(point_a[0] / point_b[0]), boot, confidence)
