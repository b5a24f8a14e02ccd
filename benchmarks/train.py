"""Training throughput per worker and 1 -> N worker scaling (issue 5), side by side in one run.

    python benchmarks/train.py --config configs/tiny-cpu.yaml --steps 30 --workers 1 2 [--out FILE] [KEY=VALUE ...]

For each worker count: a real `draftline.train.run.train` (Ray Train + DeepSpeed, validation and checkpoint only
at the last step) into a scratch data dir, on the config's hidden states. Tokens/s are the per-step figures rank 0
logs to MLflow (real, unpadded tokens of all workers / step wall time), median over the steps after `--warmup`;
wall time includes worker-group start-up. A bare reference runs the same TTT objective with torch's AdamW in one Ray
task with one worker's CPUs, no DeepSpeed, no process group, over the same samples: the gap is the distributed
overhead per worker.
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

import torch  # noqa: E402

from draftline.config import load_config  # noqa: E402
from draftline.data.prepare import prepare  # noqa: E402
from draftline.extract.run import extract  # noqa: E402
from draftline.raycluster import ensure_ray  # noqa: E402
from draftline.target.load import resolve_target_dir  # noqa: E402
from draftline.train.run import train  # noqa: E402
from draftline.utils import atomic_write_json  # noqa: E402


def bare_objective_in_ray(cfg, hidden_dir: Path, dataset_dir: Path, target_dir: Path, steps: int, warmup: int) -> dict:
    """tokens/s of forward + backward + AdamW on one worker's CPUs, without DeepSpeed or Ray Train."""
    import ray

    @ray.remote(num_cpus=cfg.train.cpus_per_worker)
    def measure(config_json: dict) -> dict:
        from transformers import AutoConfig

        from draftline.config import DraftlineConfig
        from draftline.data.prepare import load_vocab
        from draftline.drafter.model import DrafterConfig
        from draftline.extract.shards import HiddenStateShards
        from draftline.train.data import collate, load_target_head
        from draftline.train.order import sample_indices_for_step
        from draftline.train.loop import TTTObjective, build_drafter, objective_inputs

        task_cfg = DraftlineConfig.model_validate(config_json)
        torch.set_num_threads(max(1, int(task_cfg.train.cpus_per_worker)))
        torch.manual_seed(task_cfg.seed)
        shards = HiddenStateShards(hidden_dir / "train")
        sizes = [s["samples"] for s in shards.manifest["shards"]]
        d2t, t2d = load_vocab(dataset_dir)
        head = load_target_head(target_dir)
        drafter_config = DrafterConfig.from_target(
            AutoConfig.from_pretrained(target_dir), int(d2t.shape[0]), shards.aux_layer_ids,
            task_cfg.train.num_attention_heads, task_cfg.train.intermediate_size,
        )
        drafter = build_drafter(drafter_config, head, d2t, t2d)
        objective = TTTObjective(drafter, task_cfg.train.ttt_steps, task_cfg.train.ttt_decay, task_cfg.train.loss)
        optimizer = torch.optim.AdamW(objective.parameters(), lr=task_cfg.train.lr)
        tokens_per_s = []
        for step in range(steps):
            indices = sample_indices_for_step(step, 0, 1, task_cfg.train.micro_batch_size, sizes, task_cfg.seed)
            started = time.perf_counter()
            batch = collate([shards[i] for i in indices])
            loss, _ = objective(*objective_inputs(batch, head, t2d, torch.float32))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(objective.parameters(), task_cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad()
            if step >= warmup:
                tokens_per_s.append(batch.num_tokens / (time.perf_counter() - started))
        return {"tokens_per_s": statistics.median(tokens_per_s)}

    return ray.get(measure.remote(cfg.model_dump(mode="json")))


def mlflow_series(cfg, run_id: str, key: str) -> list[float]:
    from mlflow import MlflowClient

    history = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri).get_metric_history(run_id, key)
    return [m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()

    cfg = load_config(args.config, args.overrides)
    target_dir = resolve_target_dir(cfg)
    dataset_dir = prepare(cfg, target_dir)
    hidden_dir = Path(extract(cfg, dataset_dir))
    ensure_ray(cfg)
    scratch = Path(tempfile.mkdtemp(prefix="draftline-bench-train-"))
    runs = []
    try:
        bare = bare_objective_in_ray(cfg, hidden_dir, dataset_dir, target_dir, args.steps, args.warmup)
        for num_workers in args.workers:
            run_cfg = load_config(args.config, args.overrides + [
                f"data_dir={scratch / f'w{num_workers}'}",
                f"train.num_workers={num_workers}",
                f"train.max_steps={args.steps}",
                f"train.val_every={args.steps}",
                f"train.checkpoint_every={args.steps}",
                "tracking.tracking_uri=null",
                "tracking.artifact_location=null",
                "train.storage_uri=null",
            ])
            started = time.perf_counter()
            result = train(run_cfg, hidden_dir, dataset_dir, target_dir)
            wall_s = time.perf_counter() - started
            measured = slice(args.warmup, None)
            tokens_per_s = statistics.median(mlflow_series(run_cfg, result.run_id, "tokens_per_s")[measured])
            step_s = statistics.median(mlflow_series(run_cfg, result.run_id, "step_s")[measured])
            runs.append({
                "num_workers": num_workers,
                "tokens_per_s": tokens_per_s,
                "tokens_per_s_per_worker": tokens_per_s / num_workers,
                "step_s": step_s,
                "wall_s": wall_s,
                "val_acc_0": result.metrics["val_acc_0"],
            })
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    report = {
        "config": args.config,
        "overrides": args.overrides,
        "steps": args.steps,
        "micro_batch_size": cfg.train.micro_batch_size,
        "ttt_steps": cfg.train.ttt_steps,
        "zero_stage": cfg.train.zero_stage,
        "cpus_per_worker": cfg.train.cpus_per_worker,
        "cpu_count": os.cpu_count(),
        "loadavg_1m_at_end": os.getloadavg()[0],
        "bare_objective_tokens_per_s": bare["tokens_per_s"],
        "runs": runs,
    }
    one = next((r for r in runs if r["num_workers"] == 1), None)
    print(f"\nbare TTT objective (torch AdamW, one Ray task, {cfg.train.cpus_per_worker} CPU): "
          f"{bare['tokens_per_s']:.0f} tokens/s")
    print("| workers | tokens/s (all) | tokens/s per worker | per worker / bare | vs 1 worker | step s | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        scaling = r["tokens_per_s"] / one["tokens_per_s"] if one else float("nan")
        print(f"| {r['num_workers']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_per_worker']:.0f} | "
              f"{r['tokens_per_s_per_worker'] / bare['tokens_per_s']:.2f} | {scaling:.2f}x | {r['step_s']:.2f} | "
              f"{r['wall_s']:.0f} |")
    if args.out:
        atomic_write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
