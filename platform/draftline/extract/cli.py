"""`draftline extract`: hidden states for the drafter, as a Ray Train job (see draftline.extract.run)."""

from __future__ import annotations

import argparse

from draftline.cli import add_config_args, config_from_args, print_error
from draftline.config import ConfigError, DraftlineConfig
from draftline.data.prepare import prepare
from draftline.extract.online import online_extract_summary
from draftline.extract.run import extract_with_stats, summary_text
from draftline.extract.shards import ShardError
from draftline.target.load import resolve_target_dir


def add_extract_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    parser.add_argument("--split", choices=["train", "val", "all"], default="all", help="split(s) to extract (default: %(default)s)")
    parser.add_argument("--dataset-dir", default=None, help="prepared dataset dir (default: run/find `draftline prepare` for the config)")


def run_extract(cfg: DraftlineConfig, dataset_dir: str | None, split: str) -> int:
    try:
        if cfg.extract.mode == "online":  # nothing to store: training runs the target in its stream
            target_dir = resolve_target_dir(cfg)
            print(online_extract_summary(cfg, target_dir, dataset_dir or prepare(cfg, target_dir))["line"], flush=True)
            return 0
        result = extract_with_stats(cfg, dataset_dir, split)
    except ConfigError as err:
        print_error(err)
        return 2
    except (ShardError, FileNotFoundError, RuntimeError) as err:
        print_error(err)
        return 1
    print(summary_text(list(result.splits.values())), flush=True)
    print(f"[extract] hidden states: {result.location}", flush=True)
    return 0


def _cmd(args: argparse.Namespace) -> int:
    return run_extract(config_from_args(args), args.dataset_dir, args.split)


def register(subparsers) -> None:
    parser = subparsers.add_parser("extract", help="run the target over the dataset and store EAGLE-3 hidden states")
    add_extract_args(parser)
    parser.set_defaults(func=_cmd)
