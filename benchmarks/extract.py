"""Extraction throughput vs the target's bare forward, and scaling over Ray Train workers (issue 4).

    python benchmarks/extract.py --config configs/tiny-cpu.yaml --repeat 16 --workers 1 2 [KEY=VALUE ...]

(a) Paired, in a Ray task with the CPUs and threads of one extraction worker: pass by pass over the same batches,
the bare forward (base model alone; full causal LM with its head) and the worker's extraction loop (capture, encode,
sha256, atomic writes), in rotating order, so load from other processes hits all alike. Per-worker efficiency.
(b) `extract` through Ray Train on the train split with each worker count, into a fresh directory, measured over the
workers' extraction window (first shard started to last shard written; worker-group start-up is reported separately
as wall time), against the mean of the paired bare forward runs just before and after it.
The train split is tiled `--repeat` times so each window is long enough to time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

import torch  # noqa: E402

from draftline.config import load_config  # noqa: E402
from draftline.data.prepare import load_split, prepare  # noqa: E402
from draftline.extract.run import extract_with_stats  # noqa: E402
from draftline.extract.shards import num_shards, shard_sample_range  # noqa: E402
from draftline.extract.storage import Storage  # noqa: E402
from draftline.extract.worker import SplitTokens, length_sorted_batches, right_padded_batch, run_worker_shards  # noqa: E402
from draftline.raycluster import ensure_ray  # noqa: E402
from draftline.target.aux_layers import family_of  # noqa: E402
from draftline.target.load import load_target, resolve_aux_layer_ids  # noqa: E402
from draftline.utils import atomic_write_json, read_json  # noqa: E402


def tiled_dataset(dataset_dir: Path, repeat: int, out_dir: Path) -> Path:
    """A copy of the prepared dataset whose train split is repeated `repeat` times (new ids, new dataset hash)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("val.jsonl", "bench.jsonl", "vocab.safetensors"):
        shutil.copy(dataset_dir / name, out_dir / name)
    train = load_split(dataset_dir, "train")
    with open(out_dir / "train.jsonl", "w") as handle:
        for copy in range(repeat):
            for sample in train:
                handle.write(json.dumps({**sample, "id": f"{sample['id']}#{copy}"}) + "\n")
    manifest = read_json(dataset_dir / "manifest.json")
    manifest["dataset_hash"] = f"{manifest['dataset_hash']}-x{repeat}"
    atomic_write_json(out_dir / "manifest.json", manifest)
    return out_dir


def paired_tokens_per_s(cfg, model, split_tokens: SplitTokens, pad_id: int, scratch_dir: Path, rounds: int) -> dict:
    """Round by round, alternate a bare forward pass over the data (base model; causal LM) with a full extraction
    pass (`run_worker_shards`, the worker's own loop: capture, encode, sha256, atomic writes overlapped with the
    next shard's forwards) into a fresh directory, so load from other processes hits all three alike."""
    ids = resolve_aux_layer_ids(cfg, model.config.num_hidden_layers, family_of(model.config))
    batches = []
    for shard_index in range(num_shards(len(split_tokens), cfg.extract.samples_per_shard)):
        sample_range = shard_sample_range(shard_index, len(split_tokens), cfg.extract.samples_per_shard)
        sequences = [split_tokens.sample(i)[0] for i in sample_range]
        for batch in length_sorted_batches([len(s) for s in sequences], cfg.extract.batch_size):
            batches.append(right_padded_batch([sequences[i] for i in batch], pad_id))
    plan = {"aux_layer_ids": ids, "samples_per_shard": cfg.extract.samples_per_shard, "batch_size": cfg.extract.batch_size,
            "pad_id": pad_id, "dtype": cfg.extract.dtype, "shard_metadata": {}}

    @torch.no_grad()
    def bare(forward) -> None:
        for input_ids, attention_mask in batches:
            forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    def extraction(round_index: int) -> None:
        run_worker_shards(model, split_tokens, Storage(scratch_dir / f"round-{round_index}"), 0, 1, plan)
        shutil.rmtree(scratch_dir / f"round-{round_index}")

    steps = [("base_model", lambda r: bare(model.base_model)), ("causal_lm", lambda r: bare(model)), ("extract", extraction)]
    seconds = {name: 0.0 for name, _ in steps}
    for round_index in range(rounds + 1):  # round 0 warms up
        for name, step in steps[round_index % 3:] + steps[: round_index % 3]:
            started = time.perf_counter()
            step(round_index)
            if round_index > 0:
                seconds[name] += time.perf_counter() - started
    return {name: split_tokens.total_tokens * rounds / s for name, s in seconds.items()}


def paired_in_ray(cfg, split_tokens: SplitTokens, rounds: int, scratch_dir: Path) -> dict[str, float]:
    """The paired measurement in a Ray task that gets what one extraction worker gets (CPUs, threads)."""
    import ray

    @ray.remote(num_cpus=cfg.extract.cpus_per_worker)
    def measure(config_json: dict, split_tokens: SplitTokens) -> dict[str, float]:
        from draftline.config import DraftlineConfig

        task_cfg = DraftlineConfig.model_validate(config_json)
        torch.set_num_threads(max(1, int(task_cfg.extract.cpus_per_worker)))
        target = load_target(task_cfg)
        pad_id = target.tokenizer.pad_token_id or 0
        return paired_tokens_per_s(task_cfg, target.model, split_tokens, pad_id, scratch_dir, rounds)

    return ray.get(measure.remote(cfg.model_dump(mode="json"), split_tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--repeat", type=int, default=4, help="tile the train split this many times")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=4, help="paired passes over the data (plus one warm-up pass)")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()

    cfg = load_config(args.config, args.overrides)
    dataset_dir = prepare(cfg)
    scratch = Path(tempfile.mkdtemp(prefix="draftline-bench-extract-"))
    try:
        bench_dataset = tiled_dataset(dataset_dir, args.repeat, scratch / "dataset")
        split_tokens = SplitTokens.from_samples(load_split(bench_dataset, "train"))
        threads = max(1, int(cfg.extract.cpus_per_worker))
        ensure_ray(cfg)
        bare_runs = [paired_in_ray(cfg, split_tokens, args.rounds, scratch / "paired")]
        runs = []
        for num_workers in args.workers:
            run_cfg = load_config(args.config, args.overrides + [
                f"extract.num_workers={num_workers}", f"extract.storage_uri={scratch / f'hidden-w{num_workers}'}",
            ])
            result = extract_with_stats(run_cfg, bench_dataset, split="train").splits["train"]
            bare_runs.append(paired_in_ray(cfg, split_tokens, args.rounds, scratch / "paired"))
            bare_around = {k: (bare_runs[-2][k] + bare_runs[-1][k]) / 2 for k in bare_runs[-1]}
            runs.append({
                "num_workers": num_workers,
                "tokens": result.new_tokens,
                "extract_tokens_per_s": result.tokens_per_s,
                "extract_samples_per_s": result.samples_per_s,
                "bare_forward_tokens_per_s": bare_around,
                "ratio_to_bare_base_model": result.tokens_per_s / bare_around["base_model"],
                "ratio_to_bare_causal_lm": result.tokens_per_s / bare_around["causal_lm"],
                "wall_s": result.wall_s,
                "end_to_end_tokens_per_s": result.new_tokens / result.wall_s,
                "bytes_per_token": result.manifest["bytes_per_token"],
                "gb_written": result.new_bytes / 1e9,
            })
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    report = {
        "config": args.config,
        "overrides": args.overrides,
        "target": {"num_layers": cfg.target.embedded.num_layers, "hidden_size": cfg.target.embedded.hidden_size},
        "train_samples": len(split_tokens),
        "train_tokens": split_tokens.total_tokens,
        "threads_per_worker": threads,
        "batch_size": cfg.extract.batch_size,
        "samples_per_shard": cfg.extract.samples_per_shard,
        "cpu_count": os.cpu_count(),
        "loadavg_1m_at_end": os.getloadavg()[0],
        "paired_runs": bare_runs,
        "runs": runs,
    }
    one_worker = next((r for r in runs if r["num_workers"] == 1), None)
    print(f"\npaired, pass by pass in one Ray task ({threads} thread(s)), tokens/s:")
    print("| run | bare base model | bare causal LM | extraction (capture+encode+sha256+write) | extraction / base model |")
    print("|---|---|---|---|---|")
    for index, b in enumerate(bare_runs):
        print(f"| {index} | {b['base_model']:.0f} | {b['causal_lm']:.0f} | {b['extract']:.0f} | {b['extract'] / b['base_model']:.2f} |")
    print("\nRay Train extraction (bare forward = mean of the paired runs before and after):")
    print("| workers | extract tokens/s | bare base model tokens/s | ratio | ratio vs causal LM | vs 1 worker | wall s | bytes/token |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        scaling = r["extract_tokens_per_s"] / one_worker["extract_tokens_per_s"] if one_worker else float("nan")
        print(f"| {r['num_workers']} | {r['extract_tokens_per_s']:.0f} | {r['bare_forward_tokens_per_s']['base_model']:.0f} | "
              f"{r['ratio_to_bare_base_model']:.2f} | {r['ratio_to_bare_causal_lm']:.2f} | {scaling:.2f}x | "
              f"{r['wall_s']:.1f} | {r['bytes_per_token']:.0f} |")
    if args.out:
        atomic_write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
