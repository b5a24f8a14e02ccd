"""`draftline bench`: throughput, latency, accept length, speedup and losslessness of a drafter, in one run.

    draftline bench                      # latest registered version vs the target alone
    draftline bench --version 3 --sweep  # try bench.sweep_grid, store the best config per concurrency on version 3
    draftline bench --drafter DIR        # an export directory that is not registered
    draftline bench --engine vllm        # the same through vLLM (engine.backend), e.g. its CPU build
    draftline bench --prompts mt-bench   # MT-bench's 80 questions, both turns (turn 2 after the target's own answer)
    draftline bench --concurrency 1,4 bench.rounds=3  # levels as one comma-separated value; overrides may follow

The target-only engine (same backend, no speculation) runs on the same prompts as every speculative configuration,
in paired rounds whose order alternates (bench/runner.py PairedRounds); each is compared against it at each
concurrency level, on wall time and on CPU time. Output: a table, and JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftline.bench.run import run_bench, store_bench_on_version
from draftline.bench.runner import format_table
from draftline.cli import add_config_args, config_from_args
from draftline.config import DraftlineConfig
from draftline.engines import add_engine_arg, with_engine_arg
from draftline.registry import RegistryError, get_version, latest_version


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
    together = "up together for the whole bench" if report["engines_up_together"] else "started for each round"
    print(f"engines {together}; order per round: " + "; ".join(", ".join(order) for order in report["round_order"]))
    if "best" in report:
        print("best per concurrency: " + json.dumps(report["best"], sort_keys=True))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if version is not None:
        run_id = store_bench_on_version(cfg, version, report)
        print(f"stored on {cfg.registered_model_name} version {version} (MLflow run {run_id})")
    return 0
