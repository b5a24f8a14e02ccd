"""`draftline refresh`: the champion trained further on served traffic; promoted and rolled only if it holds.

1. window: the traffic store's intact records -> one per distinct prompt, the newest `refresh.max_records`, the newest
   `refresh.held_out_fraction` held out (refresh/window.py).
2. data, under `<data_dir>/refresh/<window hash>-<champion>/` (owner-only, like the store: these are user
   prompts): train.jsonl (the traffic trained on + `refresh.replay_ratio` conversations per traffic one from the
   original dataset's train split), held_out.jsonl (the held-out conversations), held_out_bench/bench.jsonl (their prompts as served, each
   under its client's segment tag) and the champion's draft vocab.
3. prepare -> extract -> train: the pipeline's own stages (`run_pipeline(..., until="train")`) on a config derived
   from the user's (`refresh_config`): data.conversations the mix, data.draft_vocab_file the champion's vocab,
   data.held_out_benchmarks + held_out.jsonl (prepare drops any conversation too close to a held-out prompt),
   train.init_from the champion's export.
4. the new version is tagged with the traffic window it saw (TrafficWindow.provenance) and its champion.
5. gate against the champion, twice: on the held-out traffic (held_out_bench; gate.* as configured), then on the
   original bench set (bench.prompts, else the original dataset's bench split) with gate.champion_margin =
   refresh.bench_champion_margin. Both hold the champion check within each segment too (client segments on the
   traffic, kinds of prompt on the bench set) where the bench has several (gate.champion_per_segment). The second
   runs only when the first passed, so the version's `gate` tag is the verdict of both.
6. both passed: `promote_and_roll` (serving rolls first, then the aliases move). Otherwise the champion stays.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from draftline.config import DraftlineConfig
from draftline.data.prepare import load_split, prepare
from draftline.data.vocab import save_vocab
from draftline.drafter.export import load_drafter
from draftline.gate import GateDecision, run_gate
from draftline.pipeline import run_pipeline
from draftline.records import StageRecord
from draftline.registry import CHAMPION, ResolvedVersion, resolve_alias
from draftline.release import promote_and_roll
from draftline.serving.traffic_store import ensure_private_dir, read_records, traffic_dir
from draftline.refresh.window import TrafficWindow, replay_sample, traffic_window
from draftline.target.load import resolve_target_dir
from draftline.tracking import mlflow_client
from draftline.train.run import TrainResult
from draftline.utils import atomic_write_json, atomic_write_text, stable_hash

PRIVATE_FILE_MODE = 0o600


class RefreshError(RuntimeError):
    """A refresh that cannot start (too little traffic); the message says what was found and the fix."""


def _log(msg: str) -> None:
    print(f"[refresh] {msg}", flush=True)


@dataclass(frozen=True)
class RefreshRecord(StageRecord):
    """What a refresh did, also written as refresh.json in its directory."""

    STAGE = "refresh"
    version: str
    champion_version: str
    promoted: bool
    traffic_gate: str  # passed | failed | inconclusive
    bench_gate: Optional[str]  # None: not run, the traffic gate did not pass
    reasons: list[str]
    window: dict[str, str]  # the traffic window's provenance tags
    work_dir: str


@dataclass(frozen=True)
class RefreshData:
    work_dir: Path
    train_file: Path
    held_out_file: Path  # conversations: prepare keeps anything close to them out of training
    held_out_bench: Path  # a bench split of the held-out prompts as served, under their client segments
    vocab_file: Path
    replayed: int


def load_window(cfg: DraftlineConfig) -> TrafficWindow:
    """The traffic window of the store (serve.traffic.dir); RefreshError with fewer than refresh.min_records."""
    store = traffic_dir(cfg)
    bad: list[tuple[Path, int]] = []
    window = traffic_window(read_records(store, on_bad_line=lambda shard, line: bad.append((shard, line))), cfg.refresh)
    if bad:
        _log(f"skipped {len(bad)} line(s) of {store} that fail their checksum (`draftline traffic stats` lists them)")
    distinct = len(window.used)
    if distinct < cfg.refresh.min_records:
        skipped = ", ".join(f"{n} {why}" for why, n in window.skipped.items()) or "none"
        raise RefreshError(
            f"the traffic store {store} holds {distinct} distinct chat request(s) ({window.records_read} record(s) read, "
            f"{window.duplicates} repeated prompt(s), skipped: {skipped}); refresh.min_records is "
            f"{cfg.refresh.min_records}: capture more traffic (serve.traffic.enabled) or lower refresh.min_records"
        )
    return window


def window_summary(window: TrafficWindow) -> str:
    """What a refresh would train and gate on, for `draftline refresh --dry-run`."""
    tags = window.provenance()
    skipped = ", ".join(f"{n} {why}" for why, n in window.skipped.items()) or "none"
    return "\n".join([
        f"traffic window {window.window_hash()}: {window.records_read} record(s) read, {window.duplicates} repeated "
        f"prompt(s) dropped, skipped: {skipped}",
        f"  train on {len(window.train)} request(s) finished {_utc(window.train[0].time_s)} .. "
        f"{_utc(window.train[-1].time_s)}",
        f"  hold out {len(window.held_out)} request(s) finished {_utc(window.held_out[0].time_s)} .. "
        f"{_utc(window.held_out[-1].time_s)}",
        f"  client segments: {tags['refresh.traffic_segments'] or 'none'}",
    ])


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def write_refresh_data(cfg: DraftlineConfig, window: TrafficWindow, original_dataset: Path,
                       champion: ResolvedVersion) -> RefreshData:
    # One directory per window and champion: the champion's vocab and the dataset built on it differ per champion.
    champion_key = stable_hash(champion.name, champion.version, champion.source)[:8]
    work_dir = cfg.data_path("refresh", f"{window.window_hash()}-{champion_key}")
    ensure_private_dir(work_dir)
    originals = [{k: s[k] for k in ("id", "messages", "tools") if k in s} for s in load_split(original_dataset, "train")]
    replay = replay_sample(originals, round(cfg.refresh.replay_ratio * len(window.train)), cfg.seed)
    train_file, held_out_file = work_dir / "train.jsonl", work_dir / "held_out.jsonl"
    _write_jsonl(train_file, [c.as_conversation() for c in window.train] + replay)
    _write_jsonl(held_out_file, [c.as_conversation() for c in window.held_out])
    held_out_bench = work_dir / "held_out_bench"
    ensure_private_dir(held_out_bench)
    _write_jsonl(held_out_bench / "bench.jsonl", [c.as_bench_sample() for c in window.held_out])
    vocab_file = work_dir / "vocab.safetensors"
    champion_drafter = load_drafter(champion.export_dir)
    save_vocab(vocab_file, champion_drafter.d2t, champion_drafter.t2d)
    atomic_write_json(work_dir / "window.json", {**window.provenance(), "skipped": window.skipped,
                                                 "replayed_conversations": len(replay)})
    return RefreshData(work_dir, train_file, held_out_file, held_out_bench, vocab_file, len(replay))


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows), mode=PRIVATE_FILE_MODE)


def with_overrides(cfg: DraftlineConfig, values: dict[str, Any]) -> DraftlineConfig:
    """`cfg` with dotted keys set, validated again."""
    tree = cfg.model_dump(mode="json")
    for dotted, value in values.items():
        *sections, key = dotted.split(".")
        node = tree
        for section in sections:
            node = node[section]
        node[key] = value
    return DraftlineConfig.model_validate(tree)


def refresh_config(cfg: DraftlineConfig, data: RefreshData, champion: ResolvedVersion) -> DraftlineConfig:
    """The config prepare, extract and train run with: the user's, on the refresh's data, from the champion."""
    refresh = cfg.refresh
    return with_overrides(cfg, {
        "name": f"{cfg.name}-refresh",
        "data.conversations": str(data.train_file),
        "data.format": "openai",
        "data.prompt_source": None,
        "data.draft_vocab_file": str(data.vocab_file),
        "data.held_out_benchmarks": [*cfg.data.held_out_benchmarks, str(data.held_out_file)],
        "regenerate.enabled": False,  # served completions are the target's own output already
        "train.init_from": str(champion.export_dir),
        "train.max_steps": refresh.train_steps or cfg.train.max_steps,
        "train.warmup_steps": min(cfg.train.warmup_steps, refresh.train_steps or cfg.train.max_steps),
        "train.lr": refresh.lr or cfg.train.lr,
    })


def tag_version(cfg: DraftlineConfig, result: TrainResult, tags: dict[str, str]) -> None:
    """On the registered version and its training run: which traffic it saw, which champion it continued."""
    client = mlflow_client(cfg)
    for key, value in tags.items():
        client.set_model_version_tag(cfg.registered_model_name, result.model_version, key, value)
        client.set_tag(result.run_id, key, value)


def refresh(cfg: DraftlineConfig, promote: bool = True) -> RefreshRecord:
    """Run a refresh (module doc); `promote=False` gates without promoting."""
    window = load_window(cfg)
    champion = resolve_alias(cfg, CHAMPION)
    target_dir = resolve_target_dir(cfg)
    original_dataset = prepare(cfg, target_dir)
    data = write_refresh_data(cfg, window, original_dataset, champion)
    _log(f"traffic window {window.window_hash()}: {len(window.train)} request(s) to train on, {len(window.held_out)} "
         f"newest held out, {window.duplicates} repeated prompt(s) dropped; {data.replayed} conversation(s) of "
         f"{original_dataset} replayed; continuing champion version {champion.version}")
    derived = refresh_config(cfg, data, champion)
    summary = run_pipeline(derived, until="train")
    result = TrainResult.from_dict(summary["train"]["outputs"], data.work_dir)
    os.chmod(summary["prepare"]["outputs"]["dataset_dir"], 0o700)  # it holds the traffic's text too
    tags = {**window.provenance(), "refresh.champion_version": champion.version,
            "refresh.replayed_conversations": str(data.replayed)}
    tag_version(cfg, result, tags)

    traffic = _gate(cfg, result.model_version, "held-out traffic", {"bench.prompts": None},
                    dataset_dir=data.held_out_bench)
    bench = None
    if traffic.passed:
        bench = _gate(cfg, result.model_version, "original bench set",
                      {"gate.champion_margin": cfg.refresh.bench_champion_margin}, dataset_dir=original_dataset)
    passed = traffic.passed and bench is not None and bench.passed
    reasons = [f"held-out traffic: {traffic.reasons}"] + ([f"original bench set: {bench.reasons}"] if bench else [])
    promoted = False
    if passed and promote:
        _log(promote_and_roll(cfg, result.model_version))
        promoted = True
    elif not passed:
        _log(f"version {result.model_version} not promoted ({'; '.join(reasons)}); champion stays version "
             f"{champion.version}")
    record = RefreshRecord(result.model_version, champion.version, promoted, traffic.verdict,
                           bench.verdict if bench else None, reasons, tags, str(data.work_dir))
    atomic_write_json(data.work_dir / "refresh.json", record.to_dict())
    return record


def _gate(cfg: DraftlineConfig, version: str, what: str, overrides: dict[str, Any],
          dataset_dir: Optional[Path] = None) -> GateDecision:
    _log(f"gate on the {what}")
    decision = run_gate(with_overrides(cfg, {**overrides, "gate.champion_per_segment": True}), version,
                        dataset_dir=dataset_dir)
    _log(f"gate on the {what}: {decision.verdict} ({decision.reasons})")
    return decision
