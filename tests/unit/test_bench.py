"""`draftline bench`: prompt sources and metrics (the real runs: tests/integration/test_bench_runs.py)."""

from __future__ import annotations

import json

import pytest

from draftline.bench.run import best_per_concurrency
from draftline.bench.prompts import prompt_from_sample
from draftline.bench.runner import percentile

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_prompt_from_sample_stops_at_the_reply():
    assert prompt_from_sample({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}) == [1, 2]


def test_best_per_concurrency_skips_lossy_and_baseline_rows():
    rows = [
        {"label": "target-only", "spec": "-", "concurrency": 1, "output_tokens_per_s": 999.0, "lossless": True},
        {"label": "v1", "spec": "3/1/4", "concurrency": 1, "output_tokens_per_s": 120.0, "lossless": True,
         "speedup": 1.2, "accept_length": 3.0},
        {"label": "v1", "spec": "5/1/6", "concurrency": 1, "output_tokens_per_s": 150.0, "lossless": False,
         "speedup": 1.5, "accept_length": 4.0},
        {"label": "v1", "spec": "3/2/6", "concurrency": 1, "output_tokens_per_s": 130.0, "lossless": True,
         "speedup": 1.3, "accept_length": 2.5},
    ]  # fmt: skip
    best = best_per_concurrency(rows)
    assert best == {"1": {"num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 6, "output_tokens_per_s": 130.0,
                          "speedup": 1.3, "accept_length": 2.5}}  # fmt: skip


def test_accept_length_by_segment_pools_each_segments_requests_over_rounds():
    from draftline.bench.runner import RequestResult, accept_length_by_segment
    from draftline.engines.base import SpecStats

    def request(prompt_id, segment, steps, tokens):
        return RequestResult(prompt_id, [0] * tokens, 0.1, [], 0.2, SpecStats(steps, tokens - steps, tokens), segment)

    rounds = [request("a", "has-tools", 4, 8), request("b", "plain", 2, 6), request("c", "plain", 4, 6),
              request("a", "has-tools", 4, 12), request("b", "plain", 0, 0)]  # a second round; b gave no steps there
    assert accept_length_by_segment(rounds) == {"has-tools": {"accept_length": 2.5, "prompts": 1},
                                                "plain": {"accept_length": 2.0, "prompts": 2}}
    assert accept_length_by_segment([request("a", "thinking-off", 0, 3)]) == {
        "thinking-off": {"accept_length": None, "prompts": 1}}
