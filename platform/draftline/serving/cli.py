"""`draftline serve`: serve the registry champion over an OpenAI-compatible API (or roll a running app)."""

from __future__ import annotations

import argparse
import sys

from draftline.cli import add_config_args, config_from_args
from draftline.release import sync_serving_to_champion
from draftline.serving.control import serve_champion


def _serve_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    # RegistryError and ServingError are cli.main's one line, exit 1.
    if args.roll:
        message = sync_serving_to_champion(cfg)
        if message is None:
            print(f"error: nothing is serving for data dir {cfg.data_dir}; start it with `draftline serve`",
                  file=sys.stderr)
            return 1
        print(message)
        return 0
    url = serve_champion(cfg, blocking=not args.detach)
    if args.detach:
        print(url)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the champion drafter (OpenAI-compatible, Ray Serve)",
        description="Start Ray Serve on serve.host:serve.port with the registry's champion (docs/serving.md).",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--detach",
        action="store_true",
        help="return after deploying (only useful with ray.address / RAY_ADDRESS: a local Ray ends with this process)",
    )
    mode.add_argument("--roll", action="store_true", help="roll the running app to the current champion and exit")
    add_config_args(parser)
    parser.set_defaults(func=_serve_command)
