"""Bench prompt sets: the bench split of the prepared dataset, or a benchmark (`bench.prompts`: a registered name such
as `mt-bench`, or any jsonl of prompts or conversations), read by the one benchmark loader (draftline.data.benchmarks).

A benchmark conversation gives one bench prompt per user turn, rendered with the target's chat template and a
generation prompt. Replies written in the file are not used: turn k is asked after the target's own greedy answers
to turns 1..k-1 (what a user talking to the target would have seen), generated once by the target alone on the
reference engine (so every engine is benched on the same prompts) and cached under `<data_dir>/benchmarks/`. `bench.num_prompts` takes the first N conversations,
every turn of each.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from draftline.config import DraftlineConfig
from draftline.data.benchmarks import Benchmark, load_benchmark
from draftline.data.contamination import user_turns
from draftline.data.conversations import Conversation
from draftline.data.masks import render as render_text
from draftline.data.prepare import load_split
from draftline.data.thinking import thinking_kwargs, thinking_mode
from draftline.engines import make_engine
from draftline.regenerate.run import TurnSettings, regenerate_conversation, turn_settings
from draftline.target.load import target_fingerprint
from draftline.utils import atomic_write_text, build_lock, stable_hash

ANSWERS_IN_FLIGHT = 8


def _log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


SEGMENTS = ("has-tools", "thinking-on", "thinking-off", "plain")


@dataclass
class BenchPrompt:
    id: str
    input_ids: list[int]
    segment: str = "plain"  # one of SEGMENTS, or a sample's own (sample_segment): the bench reports accept length per segment


def segment_of(tools: Optional[list], messages: list[dict], thinking: Optional[str]) -> str:
    """has-tools (the conversation declares or calls tools), else thinking-on/-off (data.thinking set), else plain."""
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return "has-tools"
    return f"thinking-{thinking}" if thinking else "plain"


def sample_segment(sample: dict) -> str:
    """A bench sample's own `segment` when it has one (a refresh's held-out traffic: the client's tag), else its
    kind of prompt (segment_of)."""
    return sample.get("segment") or segment_of(sample.get("tools"), sample["messages"], sample.get("thinking"))


def prompt_from_sample(sample: dict) -> list[int]:
    """A prepared sample -> its tokens up to the first assistant (loss-masked) token: where the reply starts."""
    mask = sample["loss_mask"]
    return sample["input_ids"][: mask.index(1)] if 1 in mask else list(sample["input_ids"])


def render(tokenizer, messages: list[dict], tools: Optional[list] = None, template_kwargs: Optional[dict] = None) -> list[int]:
    text = render_text(tokenizer, messages, tools, add_generation_prompt=True, template_kwargs=template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def earlier_turns(messages: list[dict]) -> list[dict]:
    """The conversation before its last user turn, replies dropped (the target writes its own) and with them the tool
    results that answered recorded calls."""
    last_user = max(i for i, _ in user_turns(messages))
    return [m for m in messages[:last_user] if m["role"] not in ("assistant", "tool")]


def _answers_path(cfg: DraftlineConfig, benchmark: Benchmark, target_dir: Path, conversations: list[Conversation]) -> Path:
    key = stable_hash(benchmark.sha256, [c.id for c in conversations], target_fingerprint(target_dir),
                      cfg.bench.max_new_tokens, cfg.target.dtype,
                      *([cfg.data.thinking, cfg.data.thinking_on_fraction] if cfg.data.thinking else []))[:16]
    name = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in Path(benchmark.name).stem)
    return cfg.data_path("benchmarks", f"{name}-answers-{key}.jsonl")


async def _answer_all(cfg: DraftlineConfig, target_dir: Path, tokenizer, conversations: list[Conversation],
                      settings: TurnSettings) -> list[dict]:
    engine = make_engine(cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"backend": "reference"})}),
                         target_dir)
    await engine.start()
    in_flight = asyncio.Semaphore(ANSWERS_IN_FLIGHT)

    async def one(conv: Conversation) -> dict:
        async with in_flight:
            return await regenerate_conversation(engine, tokenizer, {"id": conv.id, "messages": earlier_turns(conv.messages),
                                                                     "tools": conv.tools}, settings)

    try:
        return await asyncio.gather(*(one(c) for c in conversations))
    finally:
        await engine.stop()


def target_histories(cfg: DraftlineConfig, benchmark: Benchmark, target_dir: Path, tokenizer,
                     conversations: list[Conversation]) -> dict[str, list[dict]]:
    """conversation id -> its turns before the last user turn, answered by the target alone (greedy; cached)."""
    multi = [c for c in conversations if sum(1 for _ in user_turns(c.messages)) > 1]
    if not multi:
        return {}
    path = _answers_path(cfg, benchmark, target_dir, multi)
    with build_lock(path):
        if not path.exists():
            settings = turn_settings(cfg, tokenizer)
            settings = TurnSettings(0.0, 1.0, cfg.bench.max_new_tokens, cfg.seed, settings.stop_token_ids,
                                    settings.end_of_turn, settings.reasoning_tags, cfg.data.thinking,
                                    cfg.data.thinking_on_fraction)
            _log(f"{benchmark.name}: the target answers the earlier turns of {len(multi)} conversations "
                 f"(reference engine, greedy, at most {cfg.bench.max_new_tokens} tokens each)")
            records = asyncio.run(_answer_all(cfg, target_dir, tokenizer, multi, settings))
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["id"]: r["messages"] for r in records}


def conversation_prompts(cfg: DraftlineConfig, benchmark: Benchmark, target_dir: Path, tokenizer,
                         limit: Optional[int] = None) -> list[BenchPrompt]:
    """One prompt per user turn of the first `limit` conversations; turn k after the target's answers to 1..k-1."""
    conversations = benchmark.conversations[:limit]
    histories = target_histories(cfg, benchmark, target_dir, tokenizer, conversations)
    prompts: list[BenchPrompt] = []
    for conv in conversations:
        answered = histories.get(conv.id) or earlier_turns(conv.messages)
        thinking = thinking_mode(cfg.data.thinking, conv.id, cfg.data.thinking_on_fraction)
        kwargs = thinking_kwargs(tokenizer, thinking)
        for number, (_, text) in enumerate(user_turns(conv.messages), start=1):
            history = answered[: _before_user_turn(answered, number)] + [{"role": "user", "content": text}]
            prompt_id = conv.id if number == 1 else f"{conv.id}/turn{number}"
            prompts.append(BenchPrompt(prompt_id, render(tokenizer, history, conv.tools, kwargs),
                                       segment_of(conv.tools, history, thinking)))
    return prompts


def _before_user_turn(messages: list[dict], number: int) -> int:
    """How many messages of an answered history come before its user turn `number` (all of them if it has none)."""
    seen = 0
    for i, message in enumerate(messages):
        if message["role"] == "user":
            seen += 1
            if seen == number:
                return i
    return len(messages)


def load_bench_prompts(cfg: DraftlineConfig, tokenizer, dataset_dir: Optional[Path] = None,
                       target_dir: Optional[Path] = None) -> list[BenchPrompt]:
    """`bench.prompts` when set (its first `bench.num_prompts` conversations, every turn), else the prepared
    dataset's bench split (at most `bench.num_prompts` samples)."""
    limit = cfg.bench.num_prompts
    if cfg.bench.prompts:
        benchmark = load_benchmark(cfg, cfg.bench.prompts)
        prompts = conversation_prompts(cfg, benchmark, target_dir, tokenizer, limit)
        source = f"{cfg.bench.prompts} ({benchmark.path})"
    else:
        samples = load_split(dataset_dir, "bench")
        prompts = [BenchPrompt(s["id"], prompt_from_sample(s), sample_segment(s)) for s in samples[:limit]]
        source = f"{dataset_dir}/bench.jsonl"
    if not prompts:
        raise ValueError(f"no bench prompts in {source}; add prompts or raise data.split.bench_fraction")
    return prompts
