"""`draftline` command line. Each stage module registers its own subcommand (a registry, not an if-chain)."""

from __future__ import annotations

import argparse
import importlib
import sys

from draftline.config import ConfigError, DraftlineConfig, check_data_dir, load_config

# Modules with a `register(subparsers)` function. Imported lazily per command so `--help` stays fast.
COMMAND_MODULES = {
    "bootstrap-target": "draftline.target.bootstrap",
    "regenerate": "draftline.regenerate.run",
    "prepare": "draftline.data.prepare",
    "extract": "draftline.extract.cli",
    "train": "draftline.train.cli",
    "export": "draftline.drafter.cli",
    "bench": "draftline.bench.cli",
    "gate": "draftline.gate",
    "promote": "draftline.release",
    "rollback": "draftline.release",
    "serve": "draftline.serving.cli",
    "run": "draftline.pipeline",
    "sglang-command": "draftline.engines.sglang.cli",
    "check-sglang-args": "draftline.engines.sglang.cli",
}


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", default="configs/tiny-cpu.yaml", help="YAML config (default: %(default)s)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.lr=1e-4 data.max_seq_len=512"
    )


def config_from_args(args: argparse.Namespace) -> DraftlineConfig:
    cfg = load_config(args.config, list(args.overrides or []))
    check_data_dir(cfg)
    return cfg


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftline", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    seen: set[str] = set()
    for name, module_name in COMMAND_MODULES.items():
        if only is not None and name != only:
            continue
        if module_name in seen:
            continue
        seen.add(module_name)
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMAND_MODULES else None)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
