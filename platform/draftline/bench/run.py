"""A bench run: the engines to compare (the target alone and each speculative configuration of each candidate),
their paired rounds, the JSON report, and storing it on a registered version. `draftline bench` (bench/cli.py) and
the gate (gate.py) both run it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from draftline.bench.prompts import BenchPrompt, load_bench_prompts
from draftline.bench.runner import BASELINE, EngineSpec, LoadRow, PairedRounds, machine_load
from draftline.config import DraftlineConfig, SpeculativeConfig
from draftline.data.prepare import prepare
from draftline.engines.base import SamplingParams
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

    def report(self, cfg: DraftlineConfig, rows: list[LoadRow], confidence: float, schedule: dict) -> dict:
        """The JSON report; `schedule` is PairedRounds.schedule() (engines up together, round order)."""
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
            **schedule,
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
    dataset_dir: Optional[Path] = None,
) -> dict:
    """Bench the target alone and each candidate over bench.rounds paired rounds, on the prompts plan_bench picks
    (`dataset_dir`: the bench split of that prepared dataset, e.g. another run's, instead of the one cfg prepares).

    Returns the JSON report: {"rows": [...metrics per engine and concurrency...], "best": {...} (sweep only), ...}.
    """
    plan = plan_bench(cfg, candidates, sweep, temperature, dataset_dir)

    async def rounds() -> tuple[list[LoadRow], dict]:
        async with plan.paired_rounds(cfg, log) as paired:
            for _ in range(cfg.bench.rounds):
                await paired.run_round()
            return paired.rows(cfg.bench.confidence, cfg.bench.bootstrap_samples), paired.schedule()

    rows, schedule = asyncio.run(rounds())
    report = plan.report(cfg, rows, cfg.bench.confidence, schedule)
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
