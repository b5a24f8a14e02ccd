"""Peak memory and time of one TTT training step of a Llama-3.1-8B-shaped drafter, per attention path and layout.

    python benchmarks/train_memory.py [--shape llama8b|llama8b-narrow] [--runs VARIANT:LENGTH ...] [--rounds N]
                                      [--out FILE] [--device cuda] [--before-dir PLATFORM_DIR]

Variants (each run in its own subprocess: a fresh allocator, the same seed, so all build the same weights):
  materialised  the code at BEFORE_REV, unpacked with `git archive` (one [L, (k+1)L] score matrix per step, no
                recomputation); alias `before`
  blocked       this checkout, `train.attention: blocked` (query blocks from a Python loop); alias `after`
  fused         this checkout, `train.attention: fused` (one flex attention call per step)
  fused-padded  fused, a micro-batch of four samples of 1/2, 1/4, 5/32 and 3/32 of L tokens, one a row padded to
                the longest (4 rows of L/2)
  fused-packed  fused, the same four samples packed into one row of L (`train.packing`, packed_row_tokens L)
materialised, blocked and fused train one sample of L tokens; all five variants train L real tokens a step. The
last three run with `train.activation_checkpointing` on (the default), as `blocked` does.

Shapes: `llama8b` is H 4096, 32 heads (8 kv heads, head_dim 128), MLP 14336, draft vocab 32000, target vocab
128256, three aux layers; `llama8b-narrow` keeps the heads and both vocabularies at 1/8 of the width (see SHAPES).
7 TTT steps, soft loss, fp32. One step = target signals from the frozen head (`objective_inputs`) + TTT forward +
backward, through `TTTObjective`, the module the trainer runs. A fused run first runs the objective once untimed
(CPU: forward only) so the step does not include compiling flex attention.

Time: on CPU the process's CPU time (all threads) of the step, which a loaded machine inflates far less than wall
time, and wall time; on CUDA wall time with synchronisation. `--rounds N` runs the variant list N times, rotated by
one each round, and reports each variant's ratio to the first variant's time in the same round (the paired ratio),
mean and range over rounds. Memory on CPU is the process's resident set from /proc: the peak during the step (VmHWM,
reset through /proc/self/clear_refs after set-up) minus the resident set before it, i.e. what the step adds on top of
the weights, the frozen target head (tied embedding/lm_head, 2 GiB at llama8b) and the batch; the drafter's gradients
(1.6 GiB at llama8b) are part of it. On CUDA: peak allocated during the step minus allocated before it. The optimizer
step is left out: it is the same code for every variant.

`--before-dir` names an unpacked "before" platform directory (`git archive BEFORE_REV platform`), for a machine whose
copy of the repo has no git history.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
MIXED_SAMPLE_32NDS = (16, 8, 5, 3)  # the four samples of the padded/packed variants, in 32nds of L (sum: L)
# variant -> (code, attention, samples, packing)
VARIANTS = {
    "materialised": ("before", None, "one", False),
    "blocked": ("after", "blocked", "one", False),
    "fused": ("after", "fused", "one", False),
    "fused-padded": ("after", "fused", "mixed", False),
    "fused-packed": ("after", "fused", "mixed", True),
}
ALIASES = {"before": "materialised", "after": "blocked"}  # the names of the first version of this benchmark


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def sample_lengths(samples: str, length: int) -> list[int]:
    if samples == "one":
        return [length]
    return [length * n // 32 for n in MIXED_SAMPLE_32NDS]


def child(shape: str, length: int, device: str, variant: str) -> dict:
    """One training step in this process; the code is whichever draftline is on PYTHONPATH."""
    import torch

    from draftline.drafter.model import DrafterConfig, Eagle3Drafter
    from draftline.train.data import TargetHead, collate
    from draftline.train.loop import TTTObjective, objective_inputs

    _, attention, samples_kind, packing = VARIANTS[variant]
    torch.manual_seed(0)
    config = DrafterConfig(**SHAPES[shape])
    drafter = Eagle3Drafter(config)
    vocab_ids = torch.randperm(config.target_vocab_size)[: config.draft_vocab_size].sort().values
    t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
    t2d[vocab_ids] = True
    drafter.set_vocab(vocab_ids - torch.arange(config.draft_vocab_size), t2d)
    head_weight = torch.randn(config.target_vocab_size, config.hidden_size) * 0.02
    head = TargetHead(head_weight, head_weight)
    samples = [
        {
            "input_ids": torch.randint(0, config.target_vocab_size, (n,)),
            "loss_mask": torch.ones(n, dtype=torch.bool),
            "aux_hidden": torch.randn(n, config.num_aux * config.target_hidden_size),
            "final_hidden": torch.randn(n, config.hidden_size),
        }
        for n in sample_lengths(samples_kind, length)
    ]
    # The materialised code predates packing and the attention switch: it gets the arguments it knows.
    batch = collate(samples, packing=True, row_tokens=length) if packing else collate(samples)
    objective_options = {} if attention is None else {"attention": attention}
    objective = TTTObjective(drafter, TTT_STEPS, 0.8, "soft", **objective_options)
    if device != "cpu":
        drafter.to(device)
        head, batch, t2d = head.to(device, torch.float32), batch.to(device, torch.float32), t2d.to(device)
    if attention == "fused":
        _compile_untimed(objective, batch, head, t2d, device)
    if device != "cpu":
        torch.cuda.synchronize()
        baseline_kib = torch.cuda.memory_allocated() // 1024
        torch.cuda.reset_peak_memory_stats()
    else:
        baseline_kib = _proc_status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    load_before = os.getloadavg()[0]
    started, started_cpu = time.perf_counter(), time.process_time()
    loss, metrics = objective(*objective_inputs(batch, head, t2d, torch.float32))
    loss.backward()
    if device != "cpu":
        torch.cuda.synchronize()
    step_s, step_cpu_s = time.perf_counter() - started, time.process_time() - started_cpu
    peak_kib = torch.cuda.max_memory_allocated() // 1024 if device != "cpu" else _proc_status_kib("VmHWM")
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in drafter.parameters() if p.grad is not None)
    real_tokens = int(batch.attention_mask.sum())
    return {
        "shape": shape,
        "length": length,
        "device": device,
        "rows": batch.attention_mask.shape[0],
        "row_length": batch.attention_mask.shape[1],
        "sample_lengths": [len(s["input_ids"]) for s in samples],
        "real_tokens": real_tokens,
        "padding_fraction": 1 - real_tokens / batch.attention_mask.numel(),
        "grads_gib": grad_bytes / 2**30,
        "baseline_rss_gib": baseline_kib / 2**20,
        "peak_rss_gib": peak_kib / 2**20,
        "step_peak_gib": (peak_kib - baseline_kib) / 2**20,
        "step_s": step_s,
        "step_cpu_s": step_cpu_s,
        "load_1min": [load_before, os.getloadavg()[0]],
        "loss": float(loss.detach()),
        "loss_0": metrics["loss_0"],
        "loss_6": metrics[f"loss_{TTT_STEPS - 1}"],
        "acc_0": metrics["acc_0"],
        "grad_norm": float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in drafter.parameters() if p.grad is not None))),
    }


def _compile_untimed(objective, batch, head, t2d, device: str) -> None:
    """Run the objective once so flex attention is compiled before the timed step: forward only on CPU (its flex
    call is the same with and without gradients), forward and backward on CUDA; gradients dropped after."""
    import torch

    from draftline.train.loop import objective_inputs

    with torch.set_grad_enabled(device != "cpu"):
        loss, _ = objective(*objective_inputs(batch, head, t2d, torch.float32))
        if device != "cpu":
            loss.backward()
    objective.zero_grad(set_to_none=True)


def unpack_before(directory: Path) -> Path | None:
    """The platform directory at BEFORE_REV, or None (and why, printed) where this copy has no git history."""
    archive = directory / "before.tar"
    proc = subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), BEFORE_REV, "platform"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"cannot unpack {BEFORE_REV} here ({proc.stderr.strip()[-200:]}): materialised runs skipped; pass "
              "--before-dir (an unpacked `git archive {BEFORE_REV} platform`)", flush=True)
        return None
    with tarfile.open(archive) as tar:
        tar.extractall(directory, filter="data")
    return directory / "platform"


def run_child(platform_dir: Path, shape: str, length: int, device: str, variant: str) -> dict:
    path = [str(platform_dir), os.environ.get("PYTHONPATH", "")]  # the variant first; a GPU image's own packages after
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", shape, str(length), device, variant], env=env, capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {"shape": shape, "length": length, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_runs(specs: list[str]) -> list[tuple[str, int]]:
    runs = []
    for spec in specs:
        name, _, length = spec.partition(":")
        variant = ALIASES.get(name, name)
        if variant not in VARIANTS or not length.isdigit():
            raise SystemExit(f"--runs {spec!r}: expected VARIANT:LENGTH with VARIANT one of {sorted(VARIANTS)}")
        runs.append((variant, int(length)))
    return runs


def paired_ratios(results: list[dict], time_key: str) -> dict[tuple[str, int], list[float]]:
    """Per (variant, length): its time over the first variant's time at that length in the same round."""
    ratios: dict[tuple[str, int], list[float]] = {}
    for round_index in sorted({r["round"] for r in results}):
        in_round = [r for r in results if r["round"] == round_index and "error" not in r]
        for r in in_round:
            reference = next((x for x in in_round if x["variant"] == r["reference"] and x["length"] == r["length"]), None)
            if reference:
                ratios.setdefault((r["variant"], r["length"]), []).append(r[time_key] / reference[time_key])
    return ratios


def summary(results: list[dict], device: str) -> list[str]:
    time_key = "step_cpu_s" if device == "cpu" else "step_s"
    ratios = paired_ratios(results, time_key)
    lines = [
        f"| variant | L | rows x length | padding | step peak GiB (above weights) | of it grads GiB | step {'CPU ' if device == 'cpu' else ''}s"
        f" (median) | wall s (median) | x {results[0]['reference']} time: mean [min, max] over rounds | real tokens per"
        f" {'CPU ' if device == 'cpu' else ''}s | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = list(dict.fromkeys((r["variant"], r["length"]) for r in results))
    for variant, length in order:
        runs = [r for r in results if r["variant"] == variant and r["length"] == length]
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"| {variant} | {length} | {runs[0]['error']} |")
            continue
        step = statistics.median(r[time_key] for r in ok)
        ratio = ratios.get((variant, length), [])
        ratio_text = f"{statistics.mean(ratio):.2f} [{min(ratio):.2f}, {max(ratio):.2f}]" if ratio else "-"
        first = ok[0]
        lines.append(
            f"| {variant} | {length} | {first['rows']} x {first['row_length']} | {first['padding_fraction']:.0%} | "
            f"{statistics.median(r['step_peak_gib'] for r in ok):.2f} | {first['grads_gib']:.2f} | {step:.1f} | "
            f"{statistics.median(r['step_s'] for r in ok):.1f} | {ratio_text} | {first['real_tokens'] / step:.0f} | "
            f"{first['loss']:.6f} |"
        )
    loads = [x for r in results if "error" not in r for x in r["load_1min"]]
    if loads:
        lines.append(f"\n1-minute load average during the steps: {min(loads):.1f} to {max(loads):.1f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=["materialised:2048", "blocked:2048", "fused:2048"],
                        help="VARIANT:LENGTH, in this order in the first round; ratios are to the first one's time")
    parser.add_argument("--rounds", type=int, default=1, help="run the list this many times, rotated each round")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the step on a GPU, CUDA allocator figures")
    parser.add_argument("--before-dir", help="an unpacked 'before' platform dir (default: git archive BEFORE_REV)")
    parser.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        shape, length, device, variant = args.child
        print(json.dumps(child(shape, int(length), device, variant)))
        return 0

    runs = parse_runs(args.runs)
    reference = runs[0][0]
    results = []
    with tempfile.TemporaryDirectory(prefix="draftline-bench-mem-") as scratch:
        platforms = {"after": REPO / "platform"}
        if args.before_dir:
            platforms["before"] = Path(args.before_dir)
        elif any(VARIANTS[variant][0] == "before" for variant, _ in runs):
            platforms["before"] = unpack_before(Path(scratch))
        for round_index in range(args.rounds):
            shift = round_index % len(runs)
            for variant, length in runs[shift:] + runs[:shift]:
                platform_dir = platforms.get(VARIANTS[variant][0])
                outcome = (
                    run_child(platform_dir, args.shape, length, args.device, variant) if platform_dir
                    else {"shape": args.shape, "length": length, "error": f"no {BEFORE_REV} code here"}
                )
                result = {"variant": variant, "round": round_index, "reference": reference, **outcome}
                print(json.dumps(result), flush=True)
                results.append(result)
                if args.out:  # after every run: a run cut short by a time limit keeps what it measured
                    write_report(args, results)

    print(f"\n{args.shape} drafter {SHAPES[args.shape]}, {TTT_STEPS} TTT steps, fp32, on {args.device}, "
          f"{os.cpu_count()} CPUs, {args.rounds} round(s)")
    print("\n".join(summary(results, args.device)))
    return 0


def write_report(args, results: list[dict]) -> None:
    report = {"shape": args.shape, "drafter": SHAPES[args.shape], "ttt_steps": TTT_STEPS, "device": args.device,
              "rounds": args.rounds, "runs": results}
    tmp = Path(args.out + ".tmp")  # this process imports no draftline: each child imports its own variant's
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(args.out)


if __name__ == "__main__":
    sys.exit(main())
