"""`draftline run`: the whole pipeline (draftline.pipeline)."""

from __future__ import annotations

import os
import sys

from draftline.cli import add_config_args, config_from_args
from draftline.config import config_to_yaml
from draftline.pipeline import STAGE_NAMES, plan, run_pipeline
from draftline.raycluster import configured_ray_address
from draftline.serving.control import block_until_interrupted
from draftline.serving.liveness import start_command


def _cmd(args) -> int:
    cfg = config_from_args(args)
    names = plan(cfg, args.from_stage, args.until)
    if args.dry_run:
        print("# resolved config")
        print(config_to_yaml(cfg))
        print("# stages: " + " -> ".join(names))
        if args.from_stage:
            print(f"# forced from: {args.from_stage}")
        return 0

    # As this run was started, so the command can be pasted as is (`.venv/bin/draftline` after `make demo`).
    program = sys.argv[0] if os.path.basename(sys.argv[0]) == "draftline" else "draftline"
    # RegistryError, ServingError, StorageFullError...: cli.main prints the one line and exits 1.
    summary = run_pipeline(cfg, args.from_stage, keep_serving=args.serve, until=args.until,
                           start_command=start_command(program, args.config, list(args.overrides or []),
                                                       local=not configured_ray_address(cfg)))
    if args.serve and "serve" in summary:
        block_until_interrupted(cfg)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("run", help="run the whole pipeline (stages whose inputs are unchanged are skipped)")
    add_config_args(parser)
    parser.add_argument("--dry-run", action="store_true", help="validate and print the resolved config and the stages")
    parser.add_argument("--from", dest="from_stage", choices=STAGE_NAMES, help="force this stage and the ones after it")
    parser.add_argument("--until", choices=STAGE_NAMES, help="stop after this stage (e.g. promote, when a RayService serves)")
    parser.add_argument("--serve", action="store_true", help="keep serving the champion after the pipeline (Ctrl-C stops)")
    parser.set_defaults(func=_cmd)
