"""The real target (configs/smollm2-135m-cpu.yaml): the data-efficiency curve and A/B changes of the recipe.

    python benchmarks/real_target.py curve --conversations FILE --tokens 10000,20000,40000,80000 [KEY=VALUE ...]
    python benchmarks/real_target.py ab --conversations FILE --tokens 40000 --variant NAME:KEY=VALUE[,KEY=VALUE] ...
    python benchmarks/real_target.py measure --drafter DRAFTERS_DIR/HASH [--dataset DATASET_DIR] [KEY=VALUE ...]

FILE: the target's own conversations (regenerate's conversations.jsonl, or the shards it finished). Every point
trains on the first N reply tokens of the conversations in training order (by id hash, so a smaller point's data is
a prefix of a larger one's) and validates on one fixed val set (the conversations whose id hash puts them in the val
split, in every point; --val-from takes them from other conversations, e.g. the shards finished when the first point
ran). Each point runs the pipeline's own stages in this process: prepare (MT-bench held out),
extract, train (Ray Train + DeepSpeed; the exported checkpoint is the best by val est accept length), then measures
on MT-bench (first --questions questions, both turns, turn 2 after the target's own answer) with --engines: vLLM's CPU
build (accept length and per-position acceptance from vLLM's own counters) and/or the reference engine, at the
config's chain (3/1/4 by default).
Rows go to --out as they finish (one JSON object per point), with the machine's load average at the start and end.

`measure` takes a drafter a run already trained (`<data_dir>/drafters/<hash>`, e.g. from `draftline run` on the
config) and measures it the same way on MT-bench and, with --dataset, on the first --bench-prompts prompts of that
dataset's own bench split (the training distribution, never trained on), beside the estimate its val accuracies give
at the served chain length: est = 1 + a0 + a0*a1 + ... over the config's num_steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from draftline.config import load_config  # noqa: E402
from draftline.utils import split_of, stable_fraction  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m-cpu.yaml"


def read_records(path: Path) -> list[dict]:
    files = sorted(path.glob("shard-*.jsonl")) if path.is_dir() else [path]
    return [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]


def reply_tokens(record: dict) -> int:
    return int(record.get("regenerated", {}).get("output_tokens", 0))


def subset(records: list[dict], tokens: int, cfg, val_records: list[dict] | None = None) -> list[dict]:
    """The fixed val conversations plus the first training conversations (by id hash) up to `tokens` reply tokens.

    val_records: where the val conversations come from (default: `records`); a fixed set keeps val comparable while
    regenerate adds shards to `records`. The val-split conversations of `records` outside it are not trained on."""
    split = cfg.data.split
    val = [r for r in (records if val_records is None else val_records)
           if split_of(r["id"], split.val_fraction, split.bench_fraction) != "train"]
    train = sorted((r for r in records if split_of(r["id"], split.val_fraction, split.bench_fraction) == "train"),
                   key=lambda r: stable_fraction("curve:" + r["id"]))
    chosen, total = [], 0
    for record in train:
        if total >= tokens:
            break
        chosen.append(record)
        total += reply_tokens(record)
    return val + chosen


def write_subset(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": r["id"], "messages": r["messages"]}) + "\n" for r in records))
    return path


def mt_bench_prompts(cfg, target_dir: Path, questions: int) -> list:
    """The first `questions` MT-bench questions, both turns (turn 2 after the target's own answer, cached)."""
    from transformers import AutoTokenizer

    from draftline.bench.prompts import conversation_prompts
    from draftline.data.benchmarks import load_benchmark

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return conversation_prompts(cfg, load_benchmark(cfg, "mt-bench"), target_dir, tokenizer, questions)


async def mt_bench(cfg, target_dir: Path, drafter_dir: Path, prompts: list, backend: str) -> dict:
    """EAGLE-3 on MT-bench prompts, greedy: accept length as the engine counts it (vLLM: its own counters, with
    acceptance per position; reference: output tokens / verify steps)."""
    from draftline.engines import make_engine
    from draftline.engines.base import SamplingParams, SpecStats

    engine_cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"backend": backend})})
    engine = make_engine(engine_cfg, target_dir, drafter_dir=drafter_dir)
    await engine.start()
    try:
        before = await engine.spec_counters() if backend == "vllm" else None
        params = SamplingParams(max_new_tokens=cfg.bench.max_new_tokens, temperature=0.0, seed=cfg.seed)
        in_flight = asyncio.Semaphore(4)

        async def one(prompt) -> SpecStats:
            async with in_flight:
                stats = SpecStats()
                async for chunk in engine.generate(prompt.input_ids, params):
                    stats = chunk.stats or stats
                return stats

        started = time.monotonic()
        per_prompt = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.monotonic() - started
        counters = (await engine.spec_counters()).minus(before) if backend == "vllm" else None
    finally:
        await engine.stop()
    total = SpecStats()
    for stats in per_prompt:
        total = total.merge(stats)
    row = {"engine": backend, "prompts": len(prompts), "output_tokens": total.output_tokens,
           "seconds": round(seconds, 1)}
    if counters is not None:
        return {**row, "accept_length": round(counters.mean_accept_length or 0.0, 3), "drafts": counters.drafts,
                "acceptance_per_position": [round(p, 3) for p in counters.acceptance_per_position]}
    return {**row, "accept_length": round(total.accept_length, 3), "verify_steps": total.verify_steps}


def run_point(name: str, records: list[dict], tokens: int, overrides: list[str], args) -> dict:
    from draftline.data.prepare import prepare
    from draftline.extract.run import extract_with_stats
    from draftline.target.load import resolve_target_dir
    from draftline.train.run import train
    from draftline.utils import read_json

    started = time.monotonic()
    load_start = os.getloadavg()
    base = load_config(CONFIG, [f"data_dir={args.data_dir}", *args.overrides])
    chosen = subset(records, tokens, base, read_records(args.val_from) if args.val_from else None)
    source = write_subset(chosen, Path(args.data_dir) / "curve" / f"{name}.jsonl")
    cfg = load_config(CONFIG, [f"data_dir={args.data_dir}", "regenerate.enabled=false", f"data.conversations={source}",
                               *args.overrides, *overrides])
    target_dir = resolve_target_dir(cfg)
    dataset_dir = prepare(cfg, target_dir)
    report = read_json(dataset_dir / "report.json")
    extracted = extract_with_stats(cfg, dataset_dir)
    result = train(cfg, hidden_dir=str(extracted.location), dataset_dir=dataset_dir, target_dir=target_dir)
    trained_s = time.monotonic() - started
    prompts = mt_bench_prompts(cfg, target_dir, args.questions)
    measured = [{"questions": args.questions, **asyncio.run(mt_bench(cfg, target_dir, result.export_dir, prompts, backend))}
                for backend in args.engines.split(",")]
    metrics = result.metrics
    return {
        "name": name, "overrides": [*args.overrides, *overrides], "train_reply_tokens": report["masked_tokens"]["train"],
        "train_samples": report["samples"]["train"], "val_samples": report["samples"]["val"],
        "steps": cfg.train.max_steps, "best_step": result.best_step,
        "val_acc_0": metrics.get("val_acc_0"), "val_est_accept_len": metrics.get("val_est_accept_len"),
        "val_acc": [metrics.get(f"val_acc_{k}") for k in range(cfg.train.ttt_steps)],
        "mt_bench": measured, "spec": f"{cfg.engine.speculative.num_steps}/{cfg.engine.speculative.eagle_topk}/"
        f"{cfg.engine.speculative.num_draft_tokens}",
        "prepare_extract_train_s": round(trained_s, 1), "wall_s": round(time.monotonic() - started, 1),
        "load_avg_start": [round(x, 1) for x in load_start], "load_avg_end": [round(x, 1) for x in os.getloadavg()],
    }  # fmt: skip


def measure(args) -> dict:
    """A trained drafter on MT-bench and on its dataset's bench split, beside val's estimate at the served chain."""
    from transformers import AutoTokenizer

    from draftline.bench.prompts import load_bench_prompts
    from draftline.drafter.ttt import est_accept_len
    from draftline.target.load import resolve_target_dir
    from draftline.utils import read_json

    load_start = os.getloadavg()
    cfg = load_config(CONFIG, [f"data_dir={args.data_dir}", *args.overrides])
    target_dir = resolve_target_dir(cfg)
    result = read_json(args.drafter / "train_result.json")
    metrics = result.get("metrics", {})
    steps = cfg.engine.speculative.num_steps
    missing = [f"val_acc_{k}" for k in range(steps) if f"val_acc_{k}" not in metrics]
    if missing:
        raise SystemExit(f"{args.drafter}/train_result.json has no {missing}: trained with fewer TTT steps than the "
                         f"served chain's {steps}; set engine.speculative.num_steps to at most train.ttt_steps")
    val_acc = [metrics[f"val_acc_{k}"] for k in range(steps)]
    row = {"name": f"measure-{args.drafter.name}", "drafter": str(args.drafter), "overrides": args.overrides,
           "best_step": result.get("best_step"), "val_acc": val_acc,
           "val_est_accept_len_served_chain": round(est_accept_len(val_acc), 4),
           "spec": f"{steps}/{cfg.engine.speculative.eagle_topk}/{cfg.engine.speculative.num_draft_tokens}"}
    export_dir = args.drafter / "drafter"
    prompts = mt_bench_prompts(cfg, target_dir, args.questions)
    row["mt_bench"] = [{"questions": args.questions, **asyncio.run(mt_bench(cfg, target_dir, export_dir, prompts, b))}
                       for b in args.engines.split(",")]  # fmt: skip
    if args.dataset:
        split_cfg = cfg.model_copy(update={"bench": cfg.bench.model_copy(update={"num_prompts": args.bench_prompts})})
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        split = load_bench_prompts(split_cfg, tokenizer, dataset_dir=args.dataset)
        row["bench_split"] = [{"dataset": str(args.dataset), **asyncio.run(mt_bench(cfg, target_dir, export_dir, split, b))}
                              for b in args.engines.split(",")]  # fmt: skip
    row["load_avg_start"] = [round(x, 1) for x in load_start]
    row["load_avg_end"] = [round(x, 1) for x in os.getloadavg()]
    return row


def append(out: Path, row: dict) -> None:
    with open(out, "a") as handle:
        handle.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["curve", "ab", "measure"])
    parser.add_argument("--conversations", type=Path, help="curve/ab: conversations.jsonl or a shards/ directory")
    parser.add_argument("--tokens", help="curve/ab: reply tokens per point, comma-separated")
    parser.add_argument("--drafter", type=Path, help="measure: a trained drafter's directory, <data_dir>/drafters/<hash>")
    parser.add_argument("--dataset", type=Path, help="measure: also bench the prepared dataset's own bench split")
    parser.add_argument("--bench-prompts", type=int, default=24, help="measure: prompts of the bench split")
    parser.add_argument("--val-from", type=Path, help="take the val conversations from these conversations (a file "
                        "or shards/ directory) instead: one val set for points run while regenerate adds shards")
    parser.add_argument("--variant", action="append", default=[], help="ab: NAME:KEY=VALUE[,KEY=VALUE...]")
    parser.add_argument("--questions", type=int, default=20, help="MT-bench questions (both turns each)")
    parser.add_argument("--engines", default="vllm", help="engines that measure MT-bench: vllm, reference or both")
    parser.add_argument("--data-dir", default=".draftline")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/real_target.jsonl"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    if args.mode == "measure":
        if args.drafter is None:
            parser.error("measure needs --drafter <data_dir>/drafters/<hash>")
        append(args.out, measure(args))
        return 0
    if args.conversations is None or args.tokens is None:
        parser.error(f"{args.mode} needs --conversations and --tokens")
    records = read_records(args.conversations)
    sizes = [int(t) for t in args.tokens.split(",")]
    if args.mode == "curve":
        for tokens in sizes:
            append(args.out, run_point(f"curve-{tokens}", records, tokens, [], args))
        return 0
    for variant in ["baseline:", *args.variant]:
        name, _, settings = variant.partition(":")
        for tokens in sizes:
            append(args.out, run_point(f"{name}-{tokens}", records, tokens, [s for s in settings.split(",") if s], args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
