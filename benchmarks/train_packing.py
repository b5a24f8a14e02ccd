"""Real (unpadded) training tokens/s of whole `draftline train` runs, one arm per setting, side by side in one run.

    python benchmarks/train_packing.py --hidden-dir H --dataset-dir D --target-dir T --steps 20 --rounds 2 \\
        --arm padded: --arm packed:train.packing=true,train.packed_row_tokens=768 [--out FILE] [KEY=VALUE ...]

Every arm is the `draftline train` command (Ray Train + DeepSpeed, its own local Ray cluster, validation and a
checkpoint at the last step only, export and register) on the same extracted hidden states, config
(--config, default configs/smollm2-135m-cpu.yaml), KEY=VALUE overrides and steps, in a scratch data dir of its own:
`train.attention`, `train.packing` and `train.packed_row_tokens` are left out of the training hash, so two arms in
one data dir would find each other's finished run. The arms see the same samples in the same micro-batches (the
sample order depends on seed, workers and micro_batch_size only); packing changes only how a micro-batch is laid
out, so their per-step losses agree to float rounding.

Figures per run, from rank 0's per-step MLflow metrics (steps after --warmup): `tokens_per_s` (real tokens of all
workers / step wall time) and `tokens_per_cpu_s` (rank 0's real tokens / its process CPU time over the step, which a
loaded machine inflates less); padding as trained and unpacked; the whole command's wall time; the per-step loss.
`--rounds N` runs the arm list N times, rotated by one each round, and reports each arm's ratio to the first arm
in the same round (mean and range over rounds), and the largest per-step loss difference to the first arm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERIES = ("loss", "tokens_per_s", "tokens_per_cpu_s", "step_s", "step_cpu_s", "padding_fraction",
          "padding_fraction_unpacked")


def parse_arm(spec: str) -> tuple[str, list[str]]:
    name, sep, settings = spec.partition(":")
    if not sep or not name:
        raise SystemExit(f"--arm {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...] (NAME: for no overrides)")
    return name, [s for s in settings.split(",") if s]


def train_command(args, data_dir: Path, overrides: list[str]) -> list[str]:
    steps = str(args.steps)
    return [
        str(Path(sys.executable).with_name("draftline")), "train", "--config", args.config,
        f"data_dir={data_dir}", f"train.max_steps={steps}", f"train.val_every={steps}",
        f"train.checkpoint_every={steps}", *args.overrides, *overrides,
        "--hidden-dir", args.hidden_dir, "--dataset-dir", args.dataset_dir, "--target-dir", args.target_dir,
    ]


def run_arm(args, name: str, overrides: list[str], round_index: int, scratch: Path) -> dict:
    data_dir = scratch / f"{name}-r{round_index}"
    # This run's own tracking store and local Ray cluster, whatever the calling shell points at.
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "platform"), env.get("PYTHONPATH", "")) if p)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with open(scratch / f"{name}-r{round_index}.log", "w") as log:
        proc = subprocess.run(train_command(args, data_dir, overrides), env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.timeout_s)
    wall_s = time.perf_counter() - started
    row = {
        "arm": name, "round": round_index, "overrides": overrides, "wall_s": round(wall_s, 1),
        "load_avg_start": [round(x, 1) for x in load_before], "load_avg_end": [round(x, 1) for x in os.getloadavg()],
    }
    if proc.returncode != 0:
        tail = (scratch / f"{name}-r{round_index}.log").read_text()[-1500:]
        return {**row, "error": f"exit {proc.returncode}: {tail}"}
    return {**row, **run_metrics(data_dir, args.warmup)}


def run_metrics(data_dir: Path, warmup: int) -> dict:
    from mlflow import MlflowClient

    (result_file,) = data_dir.glob("drafters/*/train_result.json")
    result = json.loads(result_file.read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{data_dir / 'mlflow.db'}")
    series = {}
    for key in SERIES:
        history = sorted(client.get_metric_history(result["run_id"], key), key=lambda m: (m.step, m.timestamp))
        series[key] = [m.value for m in history]
    measured = {key: values[warmup:] for key, values in series.items()}
    return {
        "steps": len(series["loss"]),
        "tokens_per_s": statistics.median(measured["tokens_per_s"]),
        "tokens_per_cpu_s": statistics.median(measured["tokens_per_cpu_s"]),
        "step_s": statistics.median(measured["step_s"]),
        "step_cpu_s": statistics.median(measured["step_cpu_s"]),
        "padding_fraction": statistics.mean(series["padding_fraction"]),
        "padding_fraction_unpacked": statistics.mean(series["padding_fraction_unpacked"]),
        "final_loss": series["loss"][-1],
        "losses": series["loss"],
        "val": result["metrics"],
        "train_wall_s": result["wall_s"],
    }


def paired(rows: list[dict], key: str) -> dict[str, list[float]]:
    """Per arm: its `key` over the first arm's in the same round."""
    ratios: dict[str, list[float]] = {}
    for round_index in sorted({r["round"] for r in rows}):
        in_round = {r["arm"]: r for r in rows if r["round"] == round_index and "error" not in r}
        reference = in_round.get(rows[0]["reference"])
        for arm, row in in_round.items():
            if reference:
                ratios.setdefault(arm, []).append(row[key] / reference[key])
    return ratios


def loss_gaps(rows: list[dict]) -> dict[str, float]:
    """Per arm: the largest |loss - first arm's loss| at one step, over every step of every round."""
    gaps: dict[str, float] = {}
    for row in rows:
        reference = next((r for r in rows if r["round"] == row["round"] and r["arm"] == row["reference"]), None)
        if "error" in row or reference is None or "error" in reference:
            continue
        gap = max(abs(a - b) for a, b in zip(row["losses"], reference["losses"]))
        gaps[row["arm"]] = max(gaps.get(row["arm"], 0.0), gap)
    return gaps


def summary(rows: list[dict]) -> list[str]:
    def interval(values: list[float]) -> str:
        return f"{statistics.mean(values):.2f} [{min(values):.2f}, {max(values):.2f}]" if values else "-"

    wall, cpu, gaps = paired(rows, "tokens_per_s"), paired(rows, "tokens_per_cpu_s"), loss_gaps(rows)
    lines = [
        f"| arm | padding (unpacked) | real tokens/s (median) | x {rows[0]['reference']}: mean [min, max] | real tokens per "
        "CPU s, rank 0 | x: mean [min, max] | step s / CPU s | final loss | max loss gap | val est accept len | "
        "command wall s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        ok = [r for r in rows if r["arm"] == arm and "error" not in r]
        if not ok:
            lines.append(f"| {arm} | failed: {next(r for r in rows if r['arm'] == arm)['error'][-300:]} |")
            continue
        loads = [x for r in ok for x in (r["load_avg_start"][0], r["load_avg_end"][0])]

        def median(key: str) -> float:
            return statistics.median(r[key] for r in ok)

        final_losses = " / ".join(f"{r['final_loss']:.6f}" for r in ok)
        accept_lengths = " / ".join(f"{r['val'].get('val_est_accept_len', float('nan')):.4f}" for r in ok)
        lines.append(
            f"| {arm} | {median('padding_fraction'):.1%} ({median('padding_fraction_unpacked'):.1%}) | "
            f"{median('tokens_per_s'):.0f} | {interval(wall.get(arm, []))} | {median('tokens_per_cpu_s'):.0f} | "
            f"{interval(cpu.get(arm, []))} | {median('step_s'):.2f} / {median('step_cpu_s'):.2f} | "
            f"{final_losses} | {gaps.get(arm, 0.0):.1e} | {accept_lengths} | {median('wall_s'):.0f} | "
            f"{min(loads):.1f}-{max(loads):.1f} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "smollm2-135m-cpu.yaml"))
    parser.add_argument("--hidden-dir", required=True, help="<hidden_root>/<hash> from `draftline extract`")
    parser.add_argument("--dataset-dir", required=True, help="the prepared dataset those hidden states came from")
    parser.add_argument("--target-dir", required=True, help="the target's HF directory")
    parser.add_argument("--arm", action="append", required=True, help="NAME:KEY=VALUE[,KEY=VALUE...]; the first "
                        "is the reference of the ratios")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians (compiles)")
    parser.add_argument("--rounds", type=int, default=1, help="run the arm list this many times, rotated each round")
    parser.add_argument("--timeout-s", type=float, default=1800, help="deadline of one `draftline train` run")
    parser.add_argument("--out", default=None, help="write every run's figures as JSON here (after each run)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="for every arm")
    args = parser.parse_args()
    arms = [parse_arm(spec) for spec in args.arm]
    rows: list[dict] = []
    scratch = Path(tempfile.mkdtemp(prefix="draftline-bench-packing-"))
    try:
        for round_index in range(args.rounds):
            shift = round_index % len(arms)
            for name, overrides in arms[shift:] + arms[:shift]:
                row = {"reference": arms[0][0], **run_arm(args, name, overrides, round_index, scratch)}
                print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
                rows.append(row)
                if args.out:
                    Path(args.out).write_text(json.dumps(
                        {"config": args.config, "overrides": args.overrides, "steps": args.steps,
                         "warmup": args.warmup, "hidden_dir": args.hidden_dir, "cpu_count": os.cpu_count(),
                         "runs": rows}, indent=1) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{args.steps} steps per run, {args.rounds} round(s), {os.cpu_count()} CPUs; overrides {args.overrides}")
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
