"""`draftline bench`: throughput, latency, accept length, speedup and losslessness of a drafter, in one run.

    draftline bench                      # latest registered version vs the target alone
    draftline bench --version 3 --sweep  # try bench.sweep_grid, store the best config per concurrency on version 3
    draftline bench --drafter DIR        # an export directory that is not registered
    draftline bench --engine vllm        # the same through vLLM (engine.backend), e.g. its CPU build
    draftline bench --prompts mt-bench   # MT-bench's 80 questions, both turns (turn 2 after the target's own answer)
    draftline bench --concurrency 1,4 bench.rounds=3  # levels as one comma-separated value; overrides may follow

The target-only engine (same backend, no speculation) runs first on the same prompts; every speculative
configuration is compared against it at each concurrency level. Output: a table, and JSON with `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from draftline.bench.prompts import BenchPrompt, load_bench_prompts
from draftline.bench.runner import BASELINE, EngineSpec, LoadRow, PairedRounds, format_table, machine_load
from draftline.cli import add_config_args, config_from_args
from draftline.config import DraftlineConfig, SpeculativeConfig
from draftline.data.prepare import prepare
from draftline.engines import add_engine_arg, with_engine_arg
from draftline.engines.base import SamplingParams
from draftline.registry import RegistryError, get_version, latest_version
from draftline.target.load import resolve_target_dir
from draftline.tracking import BENCH_BEST_TAG, mlflow_client


def speculative_grid(cfg: DraftlineConfig, sweep: bool) -> list[SpeculativeConfig]:
    if not sweep:
        return [cfg.engine.speculative]
    base = cfg.engine.speculative
    return [
        SpeculativeConfig(algorithm=base.algorithm, num_steps=steps, eagle_topk=topk, num_draft_tokens=draft_tokens)
        for steps, topk, draft_tokens in cfg.bench.sweep_grid
    ]


def best_per_concurrency(rows: list[dict]) -> dict[str, dict]:
    """Fastest speculative configuration at each concurrency, among lossless ones when losslessness was checked."""
    best: dict[str, dict] = {}
    for row in rows:
        if row["label"] == BASELINE or row["lossless"] is False:
            continue
        key = str(row["concurrency"])
        if key not in best or row["output_tokens_per_s"] > best[key]["output_tokens_per_s"]:
            steps, topk, draft_tokens = (int(x) for x in row["spec"].split("/"))
            best[key] = {
                "num_steps": steps, "eagle_topk": topk, "num_draft_tokens": draft_tokens,
                "output_tokens_per_s": row["output_tokens_per_s"], "speedup": row["speedup"],
                "accept_length": row["accept_length"],
            }  # fmt: skip
    return best


@dataclass
class BenchPlan:
    """What a bench run compares: the target alone first, then every candidate x speculative configuration."""

    target_dir: Path
    engines: list[EngineSpec]
    prompts: list[BenchPrompt]
    params: SamplingParams
    candidates: list[tuple[str, Path, Optional[str]]]

    def paired_rounds(self, cfg: DraftlineConfig, log=print) -> PairedRounds:
        return PairedRounds(cfg, self.target_dir, self.engines, self.prompts, list(cfg.bench.concurrency), self.params, log)

    def report(self, cfg: DraftlineConfig, rows: list[LoadRow], confidence: float) -> dict:
        metrics = [row.metrics() for row in rows]
        return {
            "backend": cfg.engine.backend,
            "device": cfg.engine.device,
            "num_prompts": len(self.prompts),
            "max_new_tokens": self.params.max_new_tokens,
            "temperature": self.params.temperature,
            "concurrency": list(cfg.bench.concurrency),
            "rounds": rows[0].metrics()["rounds"],
            "confidence": confidence,
            "candidates": [{"label": label, "drafter_dir": str(d), "model_version": v} for label, d, v in self.candidates],
            "machine_load": machine_load(rows),
            "rows": metrics,
        }


def plan_bench(
    cfg: DraftlineConfig, candidates: list[tuple[str, Path, Optional[str]]], sweep: bool = False,
    temperature: float = 0.0, dataset_dir: Optional[Path] = None,
) -> BenchPlan:
    """The target alone and each candidate (label, drafter export dir, model version) on the bench prompts:
    `bench.prompts`, else the bench split of `dataset_dir`, else of the dataset `prepare` makes for cfg."""
    from transformers import AutoTokenizer

    target_dir = resolve_target_dir(cfg)
    if not cfg.bench.prompts and dataset_dir is None:
        dataset_dir = prepare(cfg, target_dir)
    prompts = load_bench_prompts(cfg, AutoTokenizer.from_pretrained(target_dir), dataset_dir, target_dir)
    engines = [EngineSpec(BASELINE)]
    for label, drafter_dir, version in candidates:
        for spec in speculative_grid(cfg, sweep):
            engines.append(EngineSpec(label, Path(drafter_dir), spec, version))
    params = SamplingParams(max_new_tokens=cfg.bench.max_new_tokens, temperature=temperature, seed=cfg.seed)
    return BenchPlan(target_dir, engines, prompts, params, candidates)


def run_bench(
    cfg: DraftlineConfig,
    candidates: list[tuple[str, Path, Optional[str]]],
    sweep: bool = False,
    temperature: float = 0.0,
    log=print,
) -> dict:
    """Bench the target alone and each candidate over bench.rounds paired rounds.

    Returns the JSON report: {"rows": [...metrics per engine and concurrency...], "best": {...} (sweep only), ...}.
    """
    plan = plan_bench(cfg, candidates, sweep, temperature)

    async def rounds() -> list[LoadRow]:
        async with plan.paired_rounds(cfg, log) as paired:
            for _ in range(cfg.bench.rounds):
                await paired.run_round()
            return paired.rows(cfg.bench.confidence, cfg.bench.bootstrap_samples)

    report = plan.report(cfg, asyncio.run(rounds()), cfg.bench.confidence)
    if sweep:
        report["best"] = best_per_concurrency(report["rows"])
    return report


def rows_of(report: dict, label: str) -> list[dict]:
    return [row for row in report["rows"] if row["label"] == label]


def store_bench_on_version(cfg: DraftlineConfig, version: str, report: dict) -> str:
    """Log the report as an MLflow run linked to the version; a sweep's best config becomes a version tag."""
    import mlflow

    client = mlflow_client(cfg)
    name = cfg.registered_model_name
    with mlflow.start_run(run_name=f"bench-{name}-v{version}") as run:
        mlflow.set_tags({"draftline.kind": "bench", "registered_model": name, "model_version": version})
        for row in rows_of(report, f"v{version}"):
            step = row["concurrency"]
            for key in ("output_tokens_per_s", "speedup", "accept_length", "itl_ms_p99"):
                if row[key] is not None:
                    mlflow.log_metric(f"{key}_{row['spec'].replace('/', '-')}", row[key], step=step)
        mlflow.log_dict(report, "bench.json")
    client.set_model_version_tag(name, version, "bench_run_id", run.info.run_id)
    if "best" in report:
        client.set_model_version_tag(name, version, BENCH_BEST_TAG, json.dumps(report["best"], sort_keys=True))
    return run.info.run_id


def concurrency_levels(value: str) -> list[int]:
    """`--concurrency 1,4` -> [1, 4]; argparse names the flag in the error it prints for ArgumentTypeError."""
    try:
        levels = [int(part) for part in value.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a comma-separated list of positive integers, e.g. --concurrency 1,4"
        )
    return levels


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmark a drafter against the target alone", description=__doc__)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--version", help="registered drafter version (default: the latest)")
    which.add_argument("--drafter", help="a drafter export directory (not registered; nothing is stored)")
    parser.add_argument("--sweep", action="store_true", help="try every bench.sweep_grid (steps, topk, draft_tokens)")
    # One comma-separated value, not nargs="+": a list option would swallow the KEY=VALUE overrides after it.
    parser.add_argument("--concurrency", type=concurrency_levels, metavar="N[,N...]",
                        help="override bench.concurrency, e.g. 1,4")
    parser.add_argument("--max-new-tokens", type=int, help="override bench.max_new_tokens")
    parser.add_argument("--num-prompts", type=int, help="override bench.num_prompts")
    parser.add_argument("--prompts", help="a benchmark: a registered name (mt-bench) or a jsonl of prompts or "
                        "conversations (override bench.prompts)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, which also checks losslessness")
    parser.add_argument("--out", help="write the JSON report here")
    add_engine_arg(parser)
    add_config_args(parser)
    parser.set_defaults(func=_bench_command)


def apply_bench_overrides(cfg: DraftlineConfig, args: argparse.Namespace) -> DraftlineConfig:
    cfg = cfg.model_copy(deep=True)
    if args.concurrency:
        cfg.bench.concurrency = args.concurrency
    if args.max_new_tokens:
        cfg.bench.max_new_tokens = args.max_new_tokens
    if args.num_prompts:
        cfg.bench.num_prompts = args.num_prompts
    if args.prompts:
        cfg.bench.prompts = args.prompts
    if args.sweep:
        cfg.bench.sweep = True
    return cfg


def _bench_command(args: argparse.Namespace) -> int:
    cfg = apply_bench_overrides(with_engine_arg(config_from_args(args), args), args)
    version = None
    try:
        if args.drafter:
            candidate = ("drafter", Path(args.drafter), None)
        else:
            version = args.version or latest_version(cfg)
            resolved = get_version(cfg, version)
            candidate = (f"v{version}", resolved.export_dir, version)
    except RegistryError as err:
        print(f"error: {err} (or pass --drafter DIR)", file=sys.stderr)
        return 1
    report = run_bench(cfg, [candidate], sweep=cfg.bench.sweep, temperature=args.temperature)
    print(format_table(report["rows"]))
    if "best" in report:
        print("best per concurrency: " + json.dumps(report["best"], sort_keys=True))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if version is not None:
        run_id = store_bench_on_version(cfg, version, report)
        print(f"stored on {cfg.registered_model_name} version {version} (MLflow run {run_id})")
    return 0
