"""SpecForge beside draftline on the real target: the same hidden states, steps, batch, lr and TTT length.

    python benchmarks/specforge_side_by_side.py --hidden HIDDEN_DIR --drafter DRAFTLINE_EXPORT --out DIR \
        [--steps 100 --questions 10 --engines vllm]

HIDDEN_DIR: the hidden states draftline extracted for a curve point (<data_dir>/hidden/<hash>, train/ and val/);
DRAFTLINE_EXPORT: the drafter draftline trained on them (its config.json also gives SpecForge's draft model the same
shape). Steps, each recorded in DIR:
1. `features/`: draftline's shards as SpecForge's offline feature files, one `.ckpt` per sample
   (`to_specforge_features`, the layout SpecForge's SGLang capture writes).
2. `specforge/`: benchmarks/specforge_train.py trains SpecForge's drafter with SpecForge's own code in its overlay
   (.peers/specforge, `make peers`) and exports it with SpecForge's `export_to_hf`.
3. `specforge-as-draftline/`: that export as a draftline export (`from_specforge_export`: the same weights in
   float32, without the target embedding SpecForge ships), which draftline's reference engine and val loop load.
4. Both drafters measured by draftline's own code: val acc_k and est accept length on the same val shards
   (`draftline.drafter.ttt.ttt_loss`, serving-faithful TTT attention), and MT-bench (benchmarks/real_target.py's
   `mt_bench`: the first --questions questions, both turns) on --engines, SpecForge's export served as SpecForge
   wrote it on vLLM.
The row goes to --results (one JSON object) with the machine's load average at the start and end.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from draftline.config import load_config  # noqa: E402
from draftline.drafter.export import config_from_hf, export_drafter, load_drafter  # noqa: E402
from draftline.drafter.model import Eagle3Drafter  # noqa: E402
from draftline.drafter.ttt import est_accept_len, ttt_loss  # noqa: E402
from draftline.extract.shards import HiddenStateShards  # noqa: E402
from draftline.target.load import resolve_target_dir  # noqa: E402
from draftline.train.data import collate, load_target_head  # noqa: E402
from draftline.utils import read_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "smollm2-135m-cpu.yaml"
PEERS_ROOT = Path(os.environ.get("DRAFTLINE_PEERS_ROOT", str(REPO / ".peers")))
# SpecForge ships the frozen target embedding in its export; draftline's export shares the target's (as the engines do).
SPECFORGE_ONLY_KEYS = ("embed_tokens.weight",)


def to_specforge_features(split_dir: str | Path, out_dir: str | Path) -> int:
    """draftline's hidden-state shards of one split -> SpecForge offline feature files, one `.ckpt` per sample.

    Same tensors under SpecForge's names: input_ids [T] and loss_mask [T] (1 on reply tokens: the same convention in
    both), hidden_state [1, T, H] the target's final (normed) hidden state, which SpecForge's TargetHead turns into
    the teacher logits, and aux_hidden_state [1, T, n_aux*H] the aux layers' outputs in draftline's order (the fc
    input of both drafters). Returns the number of samples written."""
    shards = HiddenStateShards(split_dir)
    shards.verify()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for index in range(len(shards)):
        sample = shards[index]
        feature = {
            "input_ids": sample["input_ids"].to(torch.long).clone(),
            "loss_mask": sample["loss_mask"].to(torch.long).clone(),
            "hidden_state": sample["final_hidden"].clone()[None],
            "aux_hidden_state": sample["aux_hidden"].clone()[None],
        }
        torch.save(feature, out / f"data_{index:06d}.ckpt")
    return len(shards)


def from_specforge_export(specforge_dir: str | Path, out_dir: str | Path, meta: dict | None = None) -> Path:
    """SpecForge's HF draft directory -> a draftline export of the same drafter (weights as float32).

    The parameter names are the same (tests/integration/test_peer_loaders.py checks SpecForge's warm start from
    draftline's export is bit-equal); SpecForge's export adds the target's embedding, which draftline's export
    leaves to the target. config.json is read by draftline's own reader (the ids in eagle_config, SGLang's meaning)."""
    specforge_dir = Path(specforge_dir)
    config = config_from_hf(read_json(specforge_dir / "config.json"))
    tensors = {k: v.to(torch.float32) for k, v in load_file(str(specforge_dir / "model.safetensors")).items()
               if k not in SPECFORGE_ONLY_KEYS}  # fmt: skip
    drafter = Eagle3Drafter(config)
    drafter.load_state_dict(tensors, strict=True)
    drafter.set_vocab(tensors["d2t"], tensors["t2d"])
    export_drafter(drafter, out_dir, meta={"converted_from": str(specforge_dir), **(meta or {})})
    return Path(out_dir)


def val_metrics(drafter_dir: Path, val_dir: Path, target_dir: Path, steps: int, batch_size: int = 4) -> dict:
    """draftline's val metrics of an export on a val split: acc_k over every val sample, est accept length."""
    drafter = load_drafter(drafter_dir).to(torch.float32)
    head = load_target_head(target_dir)
    shards = HiddenStateShards(val_dir)
    hits, counts = [0.0] * steps, [0] * steps
    t2d = drafter.t2d
    with torch.no_grad():
        for start in range(0, len(shards), batch_size):
            batch = collate([shards[i] for i in range(start, min(start + batch_size, len(shards)))])
            target_logits, target_ids = head.draft_signals(batch.final_hidden, t2d)
            _, metrics = ttt_loss(drafter, head.embed(batch.input_ids), batch.aux_hidden, target_logits,
                                  batch.loss_mask, target_ids=target_ids, attention_mask=batch.attention_mask,
                                  steps=steps)  # fmt: skip
            for k in range(steps):
                hits[k] += metrics[f"acc_{k}"] * metrics[f"count_{k}"]
                counts[k] += metrics[f"count_{k}"]
    accs = [hits[k] / max(counts[k], 1) for k in range(steps)]
    return {**{f"val_acc_{k}": accs[k] for k in range(steps)}, "val_est_accept_len": est_accept_len(accs)}


def train_specforge(args, features: Path, draft_config: Path, target_dir: Path, out: Path) -> Path:
    """benchmarks/specforge_train.py in SpecForge's overlay; its log beside the output. A finished run of the same
    steps in `out` is reused (a rerun after a failed bench does not train again)."""
    finished = out / "history.json"
    if finished.is_file() and read_json(finished)["history"][-1]["step"] == args.steps and (out / "export").is_dir():
        return out / "export"
    overlay = PEERS_ROOT / "specforge"
    if not (overlay / ".installed").is_file():
        raise FileNotFoundError(f"{overlay} is not built: run `make peers` (scripts/setup_peer_envs.sh)")
    env = {**os.environ, "PYTHONPATH": str(overlay), "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(REPO / "benchmarks" / "specforge_train.py"), "--train-features", str(features / "train"),
            "--val-features", str(features / "val"), "--draft-config", str(draft_config), "--target-dir",
            str(target_dir), "--out", str(out), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps), "--ttt-length", str(args.ttt_length),
            "--max-len", str(args.max_len), "--val-every", str(args.val_every)]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.log", "w") as log:
        done = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.train_timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"SpecForge training failed (exit {done.returncode}); see {out / 'train.log'}")
    return out / "export"


def mt_bench_rows(args, target_dir: Path, drafters: dict[str, Path]) -> dict[str, list[dict]]:
    """benchmarks/real_target.py's MT-bench measurement of each drafter, on the same prompts."""
    spec = importlib.util.spec_from_file_location("real_target", REPO / "benchmarks" / "real_target.py")
    real_target = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real_target)
    cfg = load_config(CONFIG, [f"data_dir={args.data_dir}", *args.overrides])
    prompts = real_target.mt_bench_prompts(cfg, target_dir, args.questions)
    return {name: [{"questions": args.questions, **asyncio.run(real_target.mt_bench(cfg, target_dir, path, prompts, engine))}
                   for engine in args.engines.split(",")]
            for name, path in drafters.items()}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", required=True, type=Path, help="draftline's <data_dir>/hidden/<hash> (train/, val/)")
    parser.add_argument("--drafter", required=True, type=Path, help="draftline's export trained on those hidden states")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--data-dir", default=".draftline", help="draftline data_dir holding the target and MT-bench")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--ttt-length", type=int, default=3)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--val-every", type=int, default=25)
    parser.add_argument("--train-timeout-s", type=float, default=7200)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--engines", default="vllm", help="engines that measure MT-bench ('' to skip the bench)")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "specforge_side_by_side.jsonl")
    parser.add_argument("overrides", nargs="*", help="config overrides for the bench (e.g. engine.vllm.enforce_eager=true)")
    args = parser.parse_args()

    started, load_start = time.monotonic(), os.getloadavg()
    target_dir = resolve_target_dir(load_config(CONFIG, [f"data_dir={args.data_dir}", *args.overrides]))
    features = args.out / "features"
    samples = {split: to_specforge_features(args.hidden / split, features / split) for split in ("train", "val")}
    converted_s = time.monotonic() - started
    specforge_export = train_specforge(args, features, args.drafter / "config.json", target_dir, args.out / "specforge")
    trained_s = time.monotonic() - started - converted_s
    as_draftline = from_specforge_export(specforge_export, args.out / "specforge-as-draftline")
    history = read_json(args.out / "specforge" / "history.json")["history"]
    drafters = {"draftline": args.drafter, "specforge": specforge_export}
    row = {
        "hidden": str(args.hidden), "draftline_drafter": str(args.drafter), "samples": samples,
        "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "ttt_length": args.ttt_length,
        "specforge_own_val": {k: v for k, v in history[-1].items() if k.startswith("val_acc")},
        "specforge_val_by_step": [{k: v for k, v in h.items() if k == "step" or k.startswith("val_acc")}
                                  for h in history if "val_acc_0" in h],
        "specforge_step_s": round(history[-1]["s"] / len(history), 2),
        "val": {"draftline": val_metrics(args.drafter, args.hidden / "val", target_dir, args.ttt_length),
                "specforge": val_metrics(as_draftline, args.hidden / "val", target_dir, args.ttt_length)},
        "convert_s": round(converted_s, 1), "specforge_train_s": round(trained_s, 1),
    }  # fmt: skip
    if args.engines:
        row["mt_bench"] = mt_bench_rows(args, target_dir, drafters)
    row.update(wall_s=round(time.monotonic() - started, 1), load_avg_start=[round(x, 1) for x in load_start],
               load_avg_end=[round(x, 1) for x in os.getloadavg()])  # fmt: skip
    with open(args.results, "a") as handle:
        handle.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
