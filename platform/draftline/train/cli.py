"""`draftline train`: train the EAGLE-3 drafter (Ray Train + DeepSpeed), export the best checkpoint, register it."""

from __future__ import annotations

import argparse
import json

from draftline.cli import add_config_args, config_from_args, print_error
from draftline.config import ConfigError, DraftlineConfig
from draftline.data.prepare import prepare
from draftline.extract.run import extract
from draftline.extract.shards import IncompatibleHiddenStates, ShardError
from draftline.target.load import resolve_target_dir
from draftline.train.run import train


def add_train_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    parser.add_argument("--hidden-dir", default=None, help="<hidden_root>/<hash> from `draftline extract` (default: run/find it for the config)")
    parser.add_argument("--dataset-dir", default=None, help="prepared dataset dir (default: run/find `draftline prepare` for the config)")
    parser.add_argument("--target-dir", default=None, help="target HF directory (default: the config's target)")


def run_train(cfg: DraftlineConfig, hidden_dir: str | None, dataset_dir: str | None, target_dir: str | None) -> int:
    try:
        target_dir = target_dir or resolve_target_dir(cfg)
        dataset_dir = dataset_dir or prepare(cfg, target_dir)
        if cfg.extract.mode == "offline":  # online: the target streams its states into training
            hidden_dir = hidden_dir or extract(cfg, dataset_dir)
        result = train(cfg, hidden_dir, dataset_dir, target_dir)
    except (ConfigError, IncompatibleHiddenStates) as err:
        print_error(err)
        return 2
    except (ShardError, FileNotFoundError, RuntimeError) as err:
        print_error(err)
        return 1
    print(json.dumps(result.to_dict(), indent=2), flush=True)
    return 0


def _cmd(args: argparse.Namespace) -> int:
    return run_train(config_from_args(args), args.hidden_dir, args.dataset_dir, args.target_dir)


def register(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train the drafter on extracted hidden states (Ray Train + DeepSpeed)")
    add_train_args(parser)
    parser.set_defaults(func=_cmd)
