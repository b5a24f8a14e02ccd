"""`draftline prepare`: tokenize conversations, build loss masks, splits and the draft vocab."""

from __future__ import annotations

from draftline.cli import add_config_args, config_from_args, print_error
from draftline.data.conversations import DataError
from draftline.data.prepare import prepare, summary_text


def _cmd(args) -> int:
    cfg = config_from_args(args)
    try:
        out = prepare(cfg)
    except (DataError, FileNotFoundError, ValueError) as err:
        print_error(err)
        return 1
    print(summary_text(out))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("prepare", help="tokenize conversations, build loss masks, splits and draft vocab")
    add_config_args(parser)
    parser.set_defaults(func=_cmd)
