"""Bench prompt sets: the bench split of the prepared dataset, or a jsonl file of prompts.

A jsonl line may hold (first match wins):
  {"input_ids": [...]}                         token ids, used as they are
  {"messages": [{"role": ..., "content": ...}]} OpenAI messages; a trailing assistant turn is dropped
  {"turns": ["...", ...]}                      MT-bench style; the first turn becomes a user message
  {"prompt": "..."}                            a single user message
Messages are rendered with the target's chat template and a generation prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from draftline.data.prepare import load_split


@dataclass
class BenchPrompt:
    id: str
    input_ids: list[int]


def prompt_from_sample(sample: dict) -> list[int]:
    """A prepared sample -> its tokens up to the first assistant (loss-masked) token: where the reply starts."""
    mask = sample["loss_mask"]
    return sample["input_ids"][: mask.index(1)] if 1 in mask else list(sample["input_ids"])


def _render(tokenizer, messages: list[dict]) -> list[int]:
    if messages and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_from_record(record: dict, tokenizer, where: str) -> list[int]:
    if "input_ids" in record:
        return [int(t) for t in record["input_ids"]]
    if "messages" in record:
        return _render(tokenizer, record["messages"])
    if "turns" in record and record["turns"]:
        return _render(tokenizer, [{"role": "user", "content": str(record["turns"][0])}])
    if "prompt" in record:
        return _render(tokenizer, [{"role": "user", "content": str(record["prompt"])}])
    raise ValueError(f"{where}: a bench prompt needs one of input_ids, messages, turns or prompt; got {sorted(record)}")


def load_prompt_file(path: str | Path, tokenizer, limit: Optional[int] = None) -> list[BenchPrompt]:
    prompts: list[BenchPrompt] = []
    with open(path) as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path} line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
            ids = prompt_from_record(record, tokenizer, where)
            if not ids:
                raise ValueError(f"{where}: the prompt is empty")
            prompts.append(BenchPrompt(str(record.get("id", record.get("question_id", line_number))), ids))
            if limit is not None and len(prompts) == limit:
                break
    return prompts


def load_bench_prompts(cfg, tokenizer, dataset_dir: Optional[Path] = None) -> list[BenchPrompt]:
    """`bench.prompts` when set, else the prepared dataset's bench split; at most `bench.num_prompts`."""
    limit = cfg.bench.num_prompts
    if cfg.bench.prompts:
        prompts = load_prompt_file(Path(cfg.bench.prompts).expanduser(), tokenizer, limit)
        source = cfg.bench.prompts
    else:
        samples = load_split(dataset_dir, "bench")
        prompts = [BenchPrompt(s["id"], prompt_from_sample(s)) for s in samples[:limit]]
        source = f"{dataset_dir}/bench.jsonl"
    if not prompts:
        raise ValueError(f"no bench prompts in {source}; add prompts or raise data.split.bench_fraction")
    return prompts
