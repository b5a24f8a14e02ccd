"""A drafter trained on the corpus's original replies vs one trained on the target's regenerated replies (issue 16).

    python benchmarks/regenerate.py [--config configs/tiny-cpu.yaml] [--steps 300] [--out FILE] [KEY=VALUE ...]

Side by side in one run, on the embedded target: the "original" corpus is the embedded default's prompts with the
stdlib docstrings as replies (what a user's dataset is: replies written by someone else). `regenerate` rewrites
those replies with the target (Ray replicas, reference engine, greedy), then both corpora go through prepare and
the same in-process drafter fit (`bench/quick_drafter.py`: same steps, batch, lr and seed). For each drafter:
val acc_0 and est accept length (TTT, chain of engine.speculative.num_steps) on the regenerated val split, i.e. on
what the target really says, and on its own val split; and the accept length measured by the reference engine
(EAGLE-3, greedy) on the bench split's prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

import torch  # noqa: E402

from draftline.config import load_config  # noqa: E402
from draftline.utils import atomic_write_json  # noqa: E402


def original_corpus(cfg, path: Path) -> Path:
    """The prompts bootstrap answers with the target, here answered with the docstrings they come from."""
    from draftline.target.corpus import stdlib_doc_pairs
    from draftline.utils import stable_fraction

    path.parent.mkdir(parents=True, exist_ok=True)
    pairs = stdlib_doc_pairs(cfg.target.embedded.corpus_max_bytes)
    chosen = sorted(pairs, key=lambda p: stable_fraction("conv:" + p.key))[: cfg.target.embedded.num_conversations]
    path.write_text("".join(
        json.dumps({"id": p.key, "messages": [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": p.answer}]}) + "\n"
        for p in chosen
    ))
    return path


@torch.no_grad()
def val_metrics(model, drafter, samples: list[dict], aux_layer_ids: list[int], num_steps: int) -> dict:
    from draftline.bench.quick_drafter import ttt_loss_on_samples
    from draftline.drafter.ttt import est_accept_len

    correct = [0.0] * num_steps
    counted = [0.0] * num_steps
    for start in range(0, len(samples), 16):
        _, metrics = ttt_loss_on_samples(model, drafter, samples[start : start + 16], aux_layer_ids, num_steps)
        for k in range(num_steps):
            correct[k] += metrics[f"acc_{k}"] * metrics[f"count_{k}"]
            counted[k] += metrics[f"count_{k}"]
    accs = [c / max(n, 1) for c, n in zip(correct, counted)]
    return {"acc_0": round(accs[0], 4), "est_accept_len": round(est_accept_len(accs), 3), "positions": int(counted[0])}


def measured_accept_len(cfg, target_dir: Path, drafter_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> float:
    from draftline.engines.base import SamplingParams, SpecStats
    from draftline.engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine(cfg, target_dir, drafter_dir=drafter_dir)
    engine.load()
    total = SpecStats()
    for prompt in prompts:
        _, stats = engine.generate_ids(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
        total = total.merge(stats)
    return round(total.accept_length, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--steps", type=int, default=300, help="drafter fit steps (both drafters)")
    parser.add_argument("--replicas", type=int, default=2, help="regenerate.num_replicas")
    parser.add_argument("--out", default="benchmarks/regenerate.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from draftline.bench.prompts import prompt_from_sample
    from draftline.bench.quick_drafter import quick_drafter
    from draftline.data.prepare import load_split, prepare
    from draftline.drafter.export import load_drafter
    from draftline.regenerate.run import regenerate
    from draftline.target.aux_layers import family_of
    from draftline.target.load import load_target, resolve_aux_layer_ids, resolve_target_dir

    base = load_config(args.config, args.overrides)
    torch.set_num_threads(1)
    target_dir = resolve_target_dir(base)
    source = original_corpus(base, base.data_path("benchmarks", "original-replies.jsonl"))
    common = [f"data.conversations={source}", f"regenerate.num_replicas={args.replicas}",
              f"regenerate.max_new_tokens_per_turn={base.target.embedded.reply_max_new_tokens}"]
    original_cfg = load_config(args.config, args.overrides + common)
    regenerated_cfg = load_config(args.config, args.overrides + common + ["regenerate.enabled=true"])

    started = time.monotonic()
    regen = regenerate(regenerated_cfg, target_dir)
    regen_seconds = time.monotonic() - started
    datasets = {"original": prepare(original_cfg, target_dir), "regenerated": prepare(regenerated_cfg, target_dir)}

    target = load_target(base, target_dir=target_dir)
    aux_layer_ids = resolve_aux_layer_ids(base, target.num_layers, family_of(target.model.config))
    num_steps = base.engine.speculative.num_steps
    bench_prompts = [prompt_from_sample(s) for s in load_split(datasets["regenerated"], "bench")][: base.bench.num_prompts]
    rows = {}
    for name, dataset_dir in datasets.items():
        fit_started = time.monotonic()
        drafter_dir = quick_drafter(base, target_dir, dataset_dir, steps=args.steps, seed=base.seed)
        drafter = load_drafter(drafter_dir).eval()
        rows[name] = {
            "fit_seconds": round(time.monotonic() - fit_started, 1),
            "val_on_regenerated": val_metrics(target.model, drafter, load_split(datasets["regenerated"], "val"), aux_layer_ids, num_steps),
            "val_on_own": val_metrics(target.model, drafter, load_split(dataset_dir, "val"), aux_layer_ids, num_steps),
            "measured_accept_len": measured_accept_len(base, target_dir, drafter_dir, bench_prompts, base.bench.max_new_tokens),
        }
        print(name, json.dumps(rows[name]), flush=True)
    result = {
        "config": args.config, "overrides": args.overrides, "steps": args.steps, "seed": base.seed,
        "num_steps": num_steps, "bench_prompts": len(bench_prompts), "bench_max_new_tokens": base.bench.max_new_tokens,
        "regenerate": {**regen.to_record().to_dict(), "seconds": round(regen_seconds, 1),
                       "conversations_per_s": round(regen.conversations / regen_seconds, 2),
                       "tokens_per_s": round(regen.output_tokens / regen_seconds, 1)},
        "drafters": rows,
    }
    atomic_write_json(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
