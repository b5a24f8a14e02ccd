"""Online vs offline hidden states (issue 15), side by side in one run.

    python benchmarks/online.py --config configs/tiny-cpu.yaml --steps 30 [--out FILE] [KEY=VALUE ...]

Offline: `draftline extract` into a scratch data dir, then `train` on the shards. Online: `train` with
extract.mode=online (the target in a Ray Data actor pool per training worker, its states streamed into training).
Both on the config's target and prepared dataset, same seed and steps (validation and checkpoint at the last step
only). Reported per mode: training tokens/s (rank 0's per-step MLflow figure, median after `--warmup` steps),
hidden-state bytes written to disk per token (offline: the shard files of train + val over their tokens; online:
whatever the run left under its scratch `hidden/`, measured the same way), bytes per token streamed (online,
measured by the workers), the extraction wall time (offline) and the wall time to a trained drafter.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from draftline.config import load_config  # noqa: E402
from draftline.data.prepare import prepare  # noqa: E402
from draftline.extract.run import extract_with_stats  # noqa: E402
from draftline.raycluster import ensure_ray  # noqa: E402
from draftline.target.load import resolve_target_dir  # noqa: E402
from draftline.train.run import train  # noqa: E402
from draftline.utils import atomic_write_json  # noqa: E402


def mlflow_series(cfg, run_id: str, key: str) -> list[float]:
    from mlflow import MlflowClient

    history = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri).get_metric_history(run_id, key)
    return [m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))]


def bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()

    loadavg_at_start = os.getloadavg()
    cfg = load_config(args.config, args.overrides)
    target_dir = resolve_target_dir(cfg)
    dataset_dir = prepare(cfg, target_dir)
    ensure_ray(cfg)
    scratch = Path(tempfile.mkdtemp(prefix="draftline-bench-online-"))
    runs = []
    try:
        for mode in ("offline", "online"):
            data_dir = scratch / mode
            run_cfg = load_config(args.config, args.overrides + [
                f"data_dir={data_dir}",
                f"extract.mode={mode}",
                f"train.max_steps={args.steps}",
                f"train.val_every={args.steps}",
                f"train.checkpoint_every={args.steps}",
                "tracking.tracking_uri=null",
                "tracking.artifact_location=null",
                "train.storage_uri=null",
                "extract.storage_uri=null",
            ])
            started = time.perf_counter()
            extract_s, hidden_dir = 0.0, None
            if mode == "offline":
                extracted = extract_with_stats(run_cfg, dataset_dir)
                extract_s, hidden_dir = time.perf_counter() - started, extracted.location
            result = train(run_cfg, hidden_dir, dataset_dir, target_dir)
            wall_s = time.perf_counter() - started
            measured = slice(args.warmup, None)
            written = bytes_under(data_dir / "hidden")
            from draftline.data.prepare import load_split

            tokens = sum(len(s["input_ids"]) for split in ("train", "val") for s in load_split(dataset_dir, split))
            streamed = mlflow_series(run_cfg, result.run_id, "streamed_bytes_per_token")
            runs.append({
                "mode": mode,
                "tokens_per_s": statistics.median(mlflow_series(run_cfg, result.run_id, "tokens_per_s")[measured]),
                "step_s": statistics.median(mlflow_series(run_cfg, result.run_id, "step_s")[measured]),
                "hidden_bytes_written": written,
                "hidden_bytes_written_per_token": written / tokens,
                "streamed_bytes_per_token": streamed[-1] if streamed else 0.0,
                "extract_s": extract_s,
                "wall_s": wall_s,
                "final_loss": mlflow_series(run_cfg, result.run_id, "loss")[-1],
                "val_acc_0": result.metrics["val_acc_0"],
            })
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    report = {
        "config": args.config,
        "overrides": args.overrides,
        "steps": args.steps,
        "num_workers": cfg.train.num_workers,
        "micro_batch_size": cfg.train.micro_batch_size,
        "extract_dtype": cfg.extract.dtype,
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": loadavg_at_start,
        "loadavg_at_end": os.getloadavg(),
        "runs": runs,
    }
    print("| mode | train tokens/s | step s | hidden bytes written / token | bytes streamed / token | extract s | "
          "wall s to a drafter | final loss | val acc_0 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['mode']} | {r['tokens_per_s']:.0f} | {r['step_s']:.2f} | {r['hidden_bytes_written_per_token']:.0f} | "
              f"{r['streamed_bytes_per_token']:.0f} | {r['extract_s']:.0f} | {r['wall_s']:.0f} | "
              f"{r['final_loss']:.4f} | {r['val_acc_0']:.3f} |")
    print(f"load average at start {report['loadavg_at_start']}, at end {report['loadavg_at_end']}")
    if args.out:
        atomic_write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
