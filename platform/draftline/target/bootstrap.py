"""Stage 1 (embedded default and shape twins): build a tiny real target LLM on this machine.

No hub download: a byte-level BPE tokenizer and a small causal LM of the configured family
(`target.embedded.family`, see target/families.py: Llama, Llama-3.1, Qwen3, Qwen3-MoE, DeepSeek-V3) are trained on (signature, docstring)
pairs from Python's standard library, formatted with a chat template (`target.embedded.chat_template`, see
target/chat_layouts.py: draftline's own, or the layout of Llama-3.1, Qwen3, DeepSeek-V3 or Kimi-K2). The result is saved with `save_pretrained`
so it loads like any HF model (and would load in SGLang on a GPU). The same directory gets `conversations.jsonl`:
prompts answered greedily by the target itself, so the drafter learns the target's own distribution.

Deterministic from the seed; cached by content hash under `<data_dir>/targets/`, so a second run is instant.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftline.config import ConfigError, DraftlineConfig, cpu_head_dim_problem
from draftline.records import StageRecord
from draftline.target.chat_layouts import ChatLayout, chat_layout
from draftline.target.corpus import DocPair, corpus_hash, stdlib_corpus_hash, stdlib_doc_pairs
from draftline.target.families import build_model_config, served_head_dims
from draftline.target.reasoning import DEFAULT_REASONING_TAGS, split_reasoning
from draftline.target.gguf_import import import_gguf_target
from draftline.target.target_dir import DONE_MARKER, publish_target_dir
from draftline.utils import build_lock, read_json, split_of, stable_fraction, stable_hash

PAD = "<|pad|>"


def _log(msg: str) -> None:
    print(f"[bootstrap-target] {msg}", flush=True)


def _train_tokenizer(texts: list[str], vocab_size: int, layout: ChatLayout | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    layout = layout or chat_layout("draftline")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, *layout.special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=layout.bos_token, eos_token=layout.eos_token, pad_token=PAD)
    tokenizer.add_tokens(list(layout.added_tokens))
    tokenizer.chat_template = layout.template
    return tokenizer


def _chat_text(tokenizer, pair: DocPair) -> str:
    messages = [{"role": "user", "content": pair.prompt}, {"role": "assistant", "content": pair.answer}]
    return tokenizer.apply_chat_template(messages, tokenize=False)


def _token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def _perplexity(model, stream: torch.Tensor, seq_len: int, batch_size: int = 16) -> float:
    model.eval()
    n_chunks = (len(stream) - 1) // seq_len
    chunks = stream[: n_chunks * seq_len + 1]
    total_nll, total_tokens = 0.0, 0
    for start in range(0, n_chunks, batch_size):
        idx = torch.arange(start, min(start + batch_size, n_chunks))
        inputs = torch.stack([chunks[i * seq_len : (i + 1) * seq_len] for i in idx])
        labels = torch.stack([chunks[i * seq_len + 1 : (i + 1) * seq_len + 1] for i in idx])
        logits = model(input_ids=inputs).logits
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        total_nll += float(nll)
        total_tokens += labels.numel()
    return math.exp(total_nll / max(total_tokens, 1))


def _unigram_perplexity(train_stream: torch.Tensor, eval_stream: torch.Tensor, vocab_size: int) -> float:
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0  # add-one smoothing
    log_probs = (counts / counts.sum()).log()
    return math.exp(-float(log_probs[eval_stream].mean()))


def _train_lm(cfg: DraftlineConfig, tokenizer, train_stream: torch.Tensor):
    from transformers import AutoModelForCausalLM

    emb = cfg.target.embedded
    torch.manual_seed(cfg.seed)
    model_config = build_model_config(emb, {
        "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    })  # fmt: skip
    for head_dim in served_head_dims(model_config):
        problem = cpu_head_dim_problem(head_dim, f"embedded target {cfg.target.name}:")
        if problem:
            raise ConfigError(problem)
    model = AutoModelForCausalLM.from_config(model_config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=emb.train_lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, emb.train_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, emb.train_steps) / emb.train_steps)),
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    seq_len = emb.train_seq_len
    max_start = len(train_stream) - seq_len - 1
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("[bootstrap-target] training tiny LM"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn(),
    ) as progress:
        task = progress.add_task("train", total=emb.train_steps, loss=float("nan"))
        # Off a terminal (a pipe, CI) rich draws the bar once, at the end: say how it goes every tenth of the steps.
        plain_every = 0 if sys.stdout.isatty() else max(1, emb.train_steps // 10)
        for step in range(1, emb.train_steps + 1):
            starts = torch.randint(0, max_start, (emb.train_batch_size,), generator=generator)
            batch = torch.stack([train_stream[s : s + seq_len + 1] for s in starts])
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            progress.update(task, advance=1, loss=loss.item())
            if plain_every and step % plain_every == 0:
                print(f"[bootstrap-target] training tiny LM: step {step}/{emb.train_steps}, loss {loss.item():.3f}",
                      flush=True)
    model.eval()
    return model


@torch.no_grad()
def _generate_replies(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 32) -> list[dict]:
    """The target's greedy assistant message for each prompt; thinking (Qwen3's layout) goes to reasoning_content."""
    tags = DEFAULT_REASONING_TAGS if all(t in tokenizer.get_added_vocab() for t in DEFAULT_REASONING_TAGS) else None
    tokenizer.padding_side = "left"
    replies: list[dict] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row in out[:, enc["input_ids"].shape[1] :]:
            content, reasoning = split_reasoning(tokenizer.decode(row, skip_special_tokens=True), tags)
            replies.append({"role": "assistant", "content": content}
                           | ({"reasoning_content": reasoning} if reasoning is not None else {}))
    tokenizer.padding_side = "right"
    return replies


def target_cache_key(cfg: DraftlineConfig, corpus: str) -> str:
    """The cache key of the embedded target: its config, the seed and the hash of its corpus (`corpus_hash`)."""
    return stable_hash(cfg.target.embedded.model_dump(mode="json"), cfg.seed, corpus)[:16]


def bootstrap_target(cfg: DraftlineConfig) -> Path:
    """Build (or find in the cache) the embedded tiny target or shape twin, or import a GGUF target (kind gguf).
    Returns its HF directory."""
    if cfg.target.kind == "gguf":
        return import_gguf_target(cfg)
    if cfg.target.kind != "embedded":
        raise ValueError(f"bootstrap-target builds the embedded target or imports a GGUF one; target.kind is "
                         f"{cfg.target.kind!r}, whose directory target.path is used as it is")
    emb = cfg.target.embedded
    corpus = stdlib_corpus_hash(emb.corpus_max_bytes, cfg.data_path("corpus"))
    out_dir = cfg.data_path("targets", f"{cfg.target.name}-{target_cache_key(cfg, corpus)}")
    with build_lock(out_dir):
        if (out_dir / DONE_MARKER).exists():
            _log(f"cached: {out_dir}")
            return out_dir
        return _build_target(cfg, stdlib_doc_pairs(emb.corpus_max_bytes), out_dir)


def _build_target(cfg: DraftlineConfig, pairs: list, out_dir: Path) -> Path:
    emb = cfg.target.embedded
    started = time.monotonic()
    torch.manual_seed(cfg.seed)
    # Held-out pairs measure perplexity; the LM never trains on them.
    heldout = [p for p in pairs if stable_fraction("lm:" + p.key) < 0.05]
    train_pairs = [p for p in pairs if stable_fraction("lm:" + p.key) >= 0.05]
    _log(f"{len(pairs)} stdlib docstring pairs ({len(train_pairs)} train, {len(heldout)} held out)")

    tokenizer = _train_tokenizer([p.prompt + "\n" + p.answer for p in train_pairs], emb.vocab_size, chat_layout(emb.chat_template))
    train_stream = _token_stream(tokenizer, [_chat_text(tokenizer, p) for p in train_pairs])
    heldout_stream = _token_stream(tokenizer, [_chat_text(tokenizer, p) for p in heldout])
    _log(f"tokenizer: {len(tokenizer)} tokens; train stream {len(train_stream)} tokens")

    model = _train_lm(cfg, tokenizer, train_stream)
    ppl = _perplexity(model, heldout_stream, emb.train_seq_len)
    unigram_ppl = _unigram_perplexity(train_stream, heldout_stream, len(tokenizer))
    _log(f"held-out perplexity {ppl:.1f} (unigram {unigram_ppl:.1f}, uniform {len(tokenizer)})")

    # Conversation prompts: a deterministic sample of all pairs (answers come from the target, not the docstring).
    chosen = sorted(pairs, key=lambda p: stable_fraction("conv:" + p.key))[: emb.num_conversations]
    replies = _generate_replies(model, tokenizer, [p.prompt for p in chosen], emb.reply_max_new_tokens)

    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    with open(tmp_dir / "conversations.jsonl", "w") as handle:
        for pair, reply in zip(chosen, replies):
            messages = [{"role": "user", "content": pair.prompt}, reply]
            handle.write(json.dumps({"id": pair.key, "messages": messages}) + "\n")
    split_counts: dict[str, int] = {}
    for pair in chosen:
        split = split_of(pair.key, cfg.data.split.val_fraction, cfg.data.split.bench_fraction)
        split_counts[split] = split_counts.get(split, 0) + 1
    summary = {
        "heldout_perplexity": ppl,
        "unigram_perplexity": unigram_ppl,
        "uniform_perplexity": len(tokenizer),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "corpus_hash": corpus_hash(pairs),
        "corpus_pairs": len(pairs),
        "train_tokens": len(train_stream),
        "num_conversations": len(chosen),
        "conversation_splits": split_counts,
        "build_seconds": round(time.monotonic() - started, 1),
    }
    return publish_target_dir(cfg, tmp_dir, out_dir, summary)


def bootstrap_summary(target_dir: Path) -> dict:
    return read_json(Path(target_dir) / DONE_MARKER)


@dataclass(frozen=True)
class BootstrapRecord(StageRecord):
    """The bootstrap stage's output: the target directory and its build summary (bootstrap.json), written as one
    flat dict."""

    STAGE = "bootstrap"
    target_dir: str
    summary: dict[str, Any]  # embedded and gguf targets summarise different things

    @classmethod
    def of(cls, target_dir: Path) -> "BootstrapRecord":
        return cls(target_dir=str(target_dir), summary=bootstrap_summary(target_dir))

    def to_dict(self) -> dict:
        return {"target_dir": self.target_dir, **self.summary}

    @classmethod
    def from_dict(cls, data: Any, source) -> "BootstrapRecord":
        if not isinstance(data, dict):
            return super().from_dict(data, source)  # which names what is wrong
        summary = {k: v for k, v in data.items() if k != "target_dir"}
        return super().from_dict({**{k: v for k, v in data.items() if k == "target_dir"}, "summary": summary}, source)
