"""`draftline bench`: prompt sources and metrics (the real runs: tests/integration/test_bench_runs.py)."""

from __future__ import annotations

import json

import pytest

from draftline.bench.cli import best_per_concurrency
from draftline.bench.prompts import load_prompt_file, prompt_from_sample
from draftline.bench.runner import percentile

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_prompt_file_formats(tmp_path, tiny_target_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"id": "ids", "input_ids": [5, 6, 7]},
        {"id": "msgs", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "drop me"}]},
        {"question_id": 81, "turns": ["hi", "second turn"]},
        {"prompt": "hi"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    prompts = load_prompt_file(path, tokenizer)
    assert [p.id for p in prompts] == ["ids", "msgs", "81", "4"]
    assert prompts[0].input_ids == [5, 6, 7]
    assert prompts[1].input_ids == prompts[2].input_ids == prompts[3].input_ids  # one user turn "hi", reply dropped
    assert "drop me" not in tokenizer.decode(prompts[1].input_ids)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl line 1: .*input_ids, messages, turns or prompt"):
        load_prompt_file(bad, tokenizer)


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
