"""Peak memory and time of one TTT training step of a Llama-3.1-8B-shaped drafter, before and after issue 15.

    python benchmarks/train_memory.py [--shape llama8b|llama8b-narrow] [--runs before:2048 after:2048] [--out FILE]
                                      [--device cuda] [--before-dir PLATFORM_DIR]

Shapes: `llama8b` is H 4096, 32 heads (8 kv heads, head_dim 128), MLP 14336, draft vocab 32000, target vocab
128256, three aux layers; `llama8b-narrow` keeps the heads and both vocabularies at 1/8 of the width (see SHAPES).
B=1, 7 TTT steps, soft loss, fp32 on CPU. One step = target signals from the frozen head
(`objective_inputs`) + TTT forward + backward, through `TTTObjective`, the module the trainer runs.

"before" is the code at BEFORE_REV (the commit this change started from), unpacked with `git archive`; "after" is
this checkout. Each run is its own subprocess (a fresh allocator) seeded alike, so both build the same weights and
inputs and must report the same loss. Memory is the process's resident set from /proc: the peak during the step
(VmHWM, reset through /proc/self/clear_refs after set-up) minus the resident set before it, i.e. what the step
adds on top of the weights, the frozen target head (tied embedding/lm_head, 2 GiB) and the batch; the gradients
of the drafter (1.6 GiB at llama8b) are part of it in both variants. The optimizer step is left out: it is the same code
before and after (AdamW state is 2x the 1.6 GiB of parameters either way).

`--device cuda` runs the step on a GPU and measures the same thing with CUDA's allocator (peak allocated during the
step minus allocated before it); `--before-dir` names an unpacked "before" platform directory (`git archive
BEFORE_REV platform`), for a machine whose copy of the repo has no git history.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE_REV = "817ac59"
LLAMA_8B = dict(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
    draft_vocab_size=32000, target_vocab_size=128256, target_hidden_size=4096, aux_layer_ids=(1, 15, 28),
    rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
)
# The same heads, draft and target vocab at 1/8 of the width: score matrices [B, 32, L, L] and logits [B, L, V] are
# the production sizes, everything H-wide is 8x smaller, and a step costs ~1/16 of the compute (a 2-core machine
# runs it at L=2048 in minutes; the full width takes hours there).
SHAPES = {
    "llama8b": LLAMA_8B,
    "llama8b-narrow": {**LLAMA_8B, "hidden_size": 512, "head_dim": 16, "intermediate_size": 1792,
                       "target_hidden_size": 512},
}
TTT_STEPS = 7


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(shape: str, length: int, device: str = "cpu") -> dict:
    """One training step in this process; the variant is whichever draftline is on PYTHONPATH."""
    import torch

    from draftline.drafter.model import DrafterConfig, Eagle3Drafter
    from draftline.train.data import Batch, TargetHead
    from draftline.train.loop import TTTObjective, objective_inputs

    torch.manual_seed(0)
    config = DrafterConfig(**SHAPES[shape])
    drafter = Eagle3Drafter(config)
    vocab_ids = torch.randperm(config.target_vocab_size)[: config.draft_vocab_size].sort().values
    t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
    t2d[vocab_ids] = True
    drafter.set_vocab(vocab_ids - torch.arange(config.draft_vocab_size), t2d)
    head_weight = torch.randn(config.target_vocab_size, config.hidden_size) * 0.02
    head = TargetHead(head_weight, head_weight)
    batch = Batch(
        input_ids=torch.randint(0, config.target_vocab_size, (1, length)),
        loss_mask=torch.ones(1, length, dtype=torch.bool),
        attention_mask=torch.ones(1, length, dtype=torch.bool),
        aux_hidden=torch.randn(1, length, config.num_aux * config.target_hidden_size),
        final_hidden=torch.randn(1, length, config.hidden_size),
    )
    objective = TTTObjective(drafter, TTT_STEPS, 0.8, "soft")
    if device != "cpu":
        drafter.to(device)
        head, batch, t2d = head.to(device, torch.float32), batch.to(device, torch.float32), t2d.to(device)
        torch.cuda.synchronize()
        baseline_kib = torch.cuda.memory_allocated() // 1024
        torch.cuda.reset_peak_memory_stats()
    else:
        baseline_kib = _proc_status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    started = time.perf_counter()
    loss, metrics = objective(*objective_inputs(batch, head, t2d, torch.float32))
    loss.backward()
    if device != "cpu":
        torch.cuda.synchronize()
    step_s = time.perf_counter() - started
    peak_kib = torch.cuda.max_memory_allocated() // 1024 if device != "cpu" else _proc_status_kib("VmHWM")
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in drafter.parameters() if p.grad is not None)
    return {
        "shape": shape,
        "length": length,
        "device": device,
        "grads_gib": grad_bytes / 2**30,
        "baseline_rss_gib": baseline_kib / 2**20,
        "peak_rss_gib": peak_kib / 2**20,
        "step_peak_gib": (peak_kib - baseline_kib) / 2**20,
        "step_s": step_s,
        "tokens_per_s": length / step_s,
        "loss": float(loss.detach()),
        "loss_0": metrics["loss_0"],
        "loss_6": metrics[f"loss_{TTT_STEPS - 1}"],
        "acc_0": metrics["acc_0"],
        "grad_norm": float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in drafter.parameters() if p.grad is not None))),
    }


def unpack_before(directory: Path) -> Path:
    archive = directory / "before.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), BEFORE_REV, "platform"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(directory, filter="data")
    return directory / "platform"


def run_child(platform_dir: Path, shape: str, length: int, device: str) -> dict:
    path = [str(platform_dir), os.environ.get("PYTHONPATH", "")]  # the variant first; a GPU image's own packages after
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", shape, str(length), device], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {"shape": shape, "length": length, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=["before:2048", "after:2048"],
                        help="VARIANT:LENGTH, VARIANT in before/after, run in this order")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the step on a GPU, CUDA allocator figures")
    parser.add_argument("--before-dir", help="an unpacked 'before' platform dir (default: git archive BEFORE_REV)")
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.child[2])))
        return 0

    results = []
    with tempfile.TemporaryDirectory(prefix="draftline-bench-mem-") as scratch:
        before = Path(args.before_dir) if args.before_dir else unpack_before(Path(scratch))
        platforms = {"before": before, "after": REPO / "platform"}
        for spec in args.runs:
            variant, length = spec.split(":")
            result = {"variant": variant, **run_child(platforms[variant], args.shape, int(length), args.device)}
            print(json.dumps(result), flush=True)
            results.append(result)

    print(f"\n{args.shape} drafter {SHAPES[args.shape]}, B=1, {TTT_STEPS} TTT steps, fp32, on {args.device}, "
          f"{os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| variant | L | step peak GiB (above weights) | of it grads GiB | peak RSS GiB | step s | loss | loss_6 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | {r['length']} | {r['error']} |")
            continue
        print(f"| {r['variant']} | {r['length']} | {r['step_peak_gib']:.2f} | {r['grads_gib']:.2f} | "
              f"{r['peak_rss_gib']:.2f} | {r['step_s']:.0f} | {r['loss']:.6f} | {r['loss_6']:.6f} |")
    by_key = {(r["variant"], r["length"]): r for r in results if "error" not in r}
    for (variant, length), after in sorted(by_key.items()):
        before = by_key.get(("before", length))
        if variant == "after" and before:
            print(f"L={length}: step peak {before['step_peak_gib'] / after['step_peak_gib']:.2f}x lower, "
                  f"step time {after['step_s'] / before['step_s']:.2f}x, "
                  f"loss difference {abs(after['loss'] - before['loss']):.2e}")
    if args.out:
        report = {"shape": args.shape, "drafter": SHAPES[args.shape], "ttt_steps": TTT_STEPS, "runs": results}
        sys.path.insert(0, str(REPO / "platform"))  # only here: a child imports the variant on its PYTHONPATH
        from draftline.utils import atomic_write_json

        atomic_write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
