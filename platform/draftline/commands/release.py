"""`draftline promote` and `draftline rollback` (draftline.release)."""

from __future__ import annotations

import argparse

from draftline import release
from draftline.cli import add_config_args, config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    promote_parser = subparsers.add_parser(
        "promote", help="make a gate-passed drafter version the champion (rolling serving first)",
        description=release.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    promote_parser.add_argument("--version", required=True, help="registered model version to promote")
    add_config_args(promote_parser)
    promote_parser.set_defaults(func=lambda args: _run(release.promote_and_roll, args, args.version))

    rollback_parser = subparsers.add_parser(
        "rollback", help="restore the previous champion (rolling serving first)",
        description=release.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(rollback_parser)
    rollback_parser.set_defaults(func=lambda args: _run(release.rollback_and_roll, args))


def _run(action, args: argparse.Namespace, *extra) -> int:
    print(action(config_from_args(args), *extra))  # RegistryError, ReleaseError, ServingError: cli.main's one line
    return 0
