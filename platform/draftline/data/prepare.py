"""Stage 2: conversations -> token ids + assistant-only loss mask, split by stable hash, draft vocab.

Output `<data_dir>/datasets/<hash>/`: train.jsonl, val.jsonl, bench.jsonl, vocab.safetensors, report.json,
manifest.json (written last: its presence means the stage finished), resolved_config.yaml.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from draftline.config import ConfigError, DraftlineConfig, write_resolved
from draftline.data.benchmarks import Benchmark, load_benchmark
from draftline.data.contamination import HeldOutIndex
from draftline.data.conversations import BadInput, Conversation, DataError, drop_duplicate_ids, read_conversations
from draftline.data.masks import TemplateError, build_masked_sample, end_of_turn_text
from draftline.data.sources import check_regenerated_for_target, conversations_path
from draftline.data.thinking import check_thinking_switch, thinking_kwargs, thinking_mode
from draftline.data.vocab import build_draft_vocab, load_vocab_file, save_vocab
from draftline.records import StageRecord
from draftline.target.load import resolve_target_dir
from draftline.utils import (
    atomic_write_json,
    build_lock,
    raise_if_storage_full,
    read_json,
    sha256_file,
    split_of,
    stable_hash,
)

SPLITS = ("train", "val", "bench")


def _log(msg: str) -> None:
    print(f"[prepare] {msg}", flush=True)


def tokenizer_fingerprint(target_dir: Path) -> str:
    files = [f for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja") if (target_dir / f).exists()]
    return stable_hash([(f, sha256_file(target_dir / f)) for f in files])[:16]


def dataset_hash(cfg: DraftlineConfig, target_dir: Path, conv_path: Path, held_out: list[Benchmark]) -> str:
    # Settings left unset are left out, so hashes from before they existed stay valid.
    unset = {"thinking", "thinking_on_fraction"} if cfg.data.thinking is None else set()
    kept_vocab = []
    if cfg.data.draft_vocab_file is None:
        unset.add("draft_vocab_file")
    else:
        kept_vocab = [sha256_file(Path(cfg.data.draft_vocab_file))]
    return stable_hash(sha256_file(conv_path), tokenizer_fingerprint(target_dir),
                       cfg.data.model_dump(mode="json", exclude=unset), [b.sha256 for b in held_out], *kept_vocab)[:16]


def prepare(cfg: DraftlineConfig, target_dir: Path | None = None) -> Path:
    target_dir = Path(target_dir) if target_dir is not None else resolve_target_dir(cfg)
    conv_path = conversations_path(cfg, target_dir)
    check_regenerated_for_target(conv_path, target_dir)
    held_out = [load_benchmark(cfg, name) for name in cfg.data.held_out_benchmarks]
    out_dir = cfg.data_path("datasets", dataset_hash(cfg, target_dir, conv_path, held_out))
    with build_lock(out_dir):
        if (out_dir / "manifest.json").exists():
            _log(f"cached: {out_dir}")
            return out_dir
        return _build_dataset(cfg, target_dir, conv_path, out_dir, held_out)


def drop_benchmark_prompts(conversations: list[Conversation], held_out: list[Benchmark]) -> tuple[list[Conversation], list[BadInput]]:
    """Conversations none of whose user turns is a held-out benchmark prompt or a near copy of one; the others named."""
    index = HeldOutIndex(held_out)
    kept: list[Conversation] = []
    problems: list[BadInput] = []
    for conv in conversations:
        why = index.conversation_match(conv.messages)
        if why is None:
            kept.append(conv)
        else:
            problems.append(BadInput(conv.file, conv.line, "benchmark", f"conversation {conv.id!r} {why}; benchmarks "
                                     "are never trained on (data.held_out_benchmarks): remove it from the data"))
    return kept, problems


def _build_dataset(cfg: DraftlineConfig, target_dir: Path, conv_path: Path, out_dir: Path,
                   held_out: list[Benchmark]) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if not tokenizer.chat_template:
        raise ValueError(
            f"the target's tokenizer at {target_dir} has no chat template, so conversations cannot be rendered the way "
            "the target is served; use the instruct/chat model, or add its template as chat_template.jinja to that "
            "directory (see docs/chat-templates.md)"
        )
    check_thinking_switch(tokenizer, cfg.data.thinking)
    target_vocab_size = len(tokenizer)
    conversations, problems = read_conversations(conv_path, cfg.data.format)
    records_read = len(conversations) + len(problems)
    eot = end_of_turn_text(tokenizer)
    splits: dict[str, list[dict]] = {s: [] for s in SPLITS}
    truncated = 0
    conversations, duplicates = drop_duplicate_ids(conversations)
    conversations, copies = drop_benchmark_prompts(conversations, held_out)
    problems += duplicates + copies
    for conv in conversations:
        thinking = thinking_mode(cfg.data.thinking, conv.id, cfg.data.thinking_on_fraction)
        try:
            sample = build_masked_sample(tokenizer, conv.messages, eot, conv.tools, thinking_kwargs(tokenizer, thinking))
        except TemplateError as err:
            problems.append(BadInput(conv.file, conv.line, "template", f"conversation {conv.id!r} {err}"))
            continue
        if len(sample.input_ids) > cfg.data.max_seq_len:
            detail = f"{len(sample.input_ids)} tokens > data.max_seq_len={cfg.data.max_seq_len}"
            if cfg.data.over_length != "truncate":
                problems.append(BadInput(conv.file, conv.line, "over_length", f"{detail}; raise max_seq_len or set data.over_length=truncate"))
                continue
            sample.input_ids = sample.input_ids[: cfg.data.max_seq_len]
            sample.loss_mask = sample.loss_mask[: cfg.data.max_seq_len]
            truncated += 1
            if not any(sample.loss_mask):
                problems.append(BadInput(conv.file, conv.line, "over_length", f"{detail}; after truncation no assistant token is left"))
                continue
        split = split_of(conv.id, cfg.data.split.val_fraction, cfg.data.split.bench_fraction)
        record = {"id": conv.id, "input_ids": sample.input_ids, "loss_mask": sample.loss_mask, "messages": conv.messages}
        if conv.tools:
            record["tools"] = conv.tools
        if thinking:
            record["thinking"] = thinking
        splits[split].append(record)

    # Over-long samples follow data.over_length; every other problem follows data.on_bad_input.
    over_length = [p for p in problems if p.kind == "over_length"]
    other = [p for p in problems if p.kind != "over_length"]
    if (other and cfg.data.on_bad_input == "fail") or (over_length and cfg.data.over_length == "fail"):
        raise DataError(problems)
    if not splits["train"]:
        raise DataError(problems + [BadInput(str(conv_path), 0, "bad_field", "no usable training conversation is left")])

    masked_ids = [t for s in splits["train"] for t, m in zip(s["input_ids"], s["loss_mask"]) if m]
    if cfg.data.draft_vocab_file is not None:
        d2t, t2d, vocab_stats = kept_draft_vocab(cfg, masked_ids, target_vocab_size)
    else:
        always = [tokenizer.convert_tokens_to_ids(eot)] if eot else []
        d2t, t2d, vocab_stats = build_draft_vocab(masked_ids, target_vocab_size, cfg.data.draft_vocab_size, always)

    by_kind: dict[str, int] = {}
    for p in problems:
        by_kind[p.kind] = by_kind.get(p.kind, 0) + 1
    report = {
        "source": str(conv_path),
        "records_read": records_read,
        "samples": {s: len(v) for s, v in splits.items()},
        "tokens": {s: sum(len(x["input_ids"]) for x in v) for s, v in splits.items()},
        "masked_tokens": {s: sum(sum(x["loss_mask"]) for x in v) for s, v in splits.items()},
        "truncated": truncated,
        "bad_input": {"policy": cfg.data.on_bad_input, "count": len(problems), "by_kind": by_kind, "items": [str(p) for p in problems]},
        "draft_vocab": {"size": cfg.data.draft_vocab_size, "target_vocab_size": target_vocab_size, **vocab_stats},
        "held_out_benchmarks": [{"name": b.name, "path": str(b.path), "sha256": b.sha256,
                                 "prompts": len(b.conversations)} for b in held_out],
    }
    manifest = {
        "dataset_hash": out_dir.name,
        "conversations_sha256": sha256_file(conv_path),
        "tokenizer_fingerprint": tokenizer_fingerprint(target_dir),
        "target_dir": str(target_dir),
        "target_vocab_size": target_vocab_size,
        "draft_vocab_size": cfg.data.draft_vocab_size,
        "samples": report["samples"],
        "held_out_benchmarks": {b.name: b.sha256 for b in held_out},
    }
    _write_dataset_dir(cfg, out_dir, splits, d2t, t2d, report, manifest)
    return out_dir


def kept_draft_vocab(cfg: DraftlineConfig, masked_ids: list[int], target_vocab_size: int):
    """data.draft_vocab_file's (d2t, t2d, stats), checked against the target and data.draft_vocab_size."""
    path = Path(cfg.data.draft_vocab_file)
    if not path.is_file():
        raise ConfigError(f"data.draft_vocab_file={path} does not exist; point it at a vocab.safetensors (d2t, t2d) "
                          "or leave it empty to build the draft vocab from the train split")
    d2t, t2d = load_vocab_file(path)
    if t2d.shape[0] != target_vocab_size or d2t.shape[0] != cfg.data.draft_vocab_size:
        raise ConfigError(
            f"data.draft_vocab_file={path} maps {d2t.shape[0]} draft tokens onto a target vocab of {t2d.shape[0]}; this "
            f"target has {target_vocab_size} tokens and data.draft_vocab_size is {cfg.data.draft_vocab_size}: set "
            "data.draft_vocab_size to match, or use a vocab built for this target"
        )
    in_vocab = t2d.bool().tolist()
    covered = sum(1 for t in masked_ids if in_vocab[t])
    return d2t, t2d, {"kept_from": str(path), "distinct_masked_tokens": len(set(masked_ids)),
                      "masked_tokens": len(masked_ids), "coverage": covered / len(masked_ids) if masked_ids else 0.0}


def _write_dataset_dir(cfg: DraftlineConfig, out_dir: Path, splits: dict[str, list[dict]], d2t, t2d, report: dict,
                       manifest: dict) -> None:
    """Write into a temp directory renamed into place at the end: a full disk (or a kill) leaves no dataset
    directory that looks finished, and a rerun starts clean."""
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        with raise_if_storage_full(tmp_dir):
            tmp_dir.mkdir(parents=True)
        for split, samples in splits.items():
            with raise_if_storage_full(tmp_dir / f"{split}.jsonl"), open(tmp_dir / f"{split}.jsonl", "w") as handle:
                for sample in samples:
                    handle.write(json.dumps(sample) + "\n")
        save_vocab(tmp_dir / "vocab.safetensors", d2t, t2d)
        atomic_write_json(tmp_dir / "report.json", report)
        write_resolved(cfg, tmp_dir)
        atomic_write_json(tmp_dir / "manifest.json", manifest)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def load_split(dataset_dir: str | Path, split: str) -> list[dict]:
    with open(Path(dataset_dir) / f"{split}.jsonl") as handle:
        return [json.loads(line) for line in handle]


def load_vocab(dataset_dir: str | Path):
    return load_vocab_file(Path(dataset_dir) / "vocab.safetensors")


@dataclass(frozen=True)
class PrepareRecord(StageRecord):
    """The prepare stage's output: the dataset directory and its samples per split."""

    STAGE = "prepare"
    dataset_dir: str
    report: dict[str, int]  # split -> samples (report.json's "samples")

    @classmethod
    def of(cls, dataset_dir: Path) -> "PrepareRecord":
        return cls(dataset_dir=str(dataset_dir), report=read_json(dataset_dir / "report.json")["samples"])


def summary_text(dataset_dir: Path) -> str:
    report = read_json(dataset_dir / "report.json")
    lines = [f"dataset {dataset_dir}"]
    for split in SPLITS:
        lines.append(
            f"  {split:5s}: {report['samples'][split]:5d} samples, {report['tokens'][split]:7d} tokens, "
            f"{report['masked_tokens'][split]:7d} assistant tokens"
        )
    bad = report["bad_input"]
    lines.append(f"  bad input: {bad['count']} ({', '.join(f'{k}={v}' for k, v in bad['by_kind'].items()) or 'none'}), policy {bad['policy']}")
    for item in bad["items"][:5]:
        lines.append(f"    {item}")
    lines.append(f"  truncated to max_seq_len: {report['truncated']}")
    held_out = report.get("held_out_benchmarks") or []
    if held_out:
        dropped = bad["by_kind"].get("benchmark", 0)
        names = ", ".join(f"{b['name']} ({b['prompts']} prompts)" for b in held_out)
        lines.append(f"  held out: {names}; {dropped} conversation(s) dropped as benchmark copies")
    vocab = report["draft_vocab"]
    lines.append(
        f"  draft vocab: {vocab['size']} of {vocab['target_vocab_size']} target tokens, "
        f"covers {vocab['coverage']:.1%} of {vocab['masked_tokens']} assistant tokens"
    )
    return "\n".join(lines)
