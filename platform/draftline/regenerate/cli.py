"""`draftline regenerate`: answer every user turn of data.conversations with the target."""

from __future__ import annotations

from draftline.cli import add_config_args, config_from_args, print_error
from draftline.data.conversations import DataError, NoConversationsError
from draftline.regenerate.run import regenerate, summary_text


def _cmd(args) -> int:
    if args.limit is not None:
        args.overrides = list(args.overrides or []) + [f"regenerate.limit={args.limit}"]
    cfg = config_from_args(args)
    try:
        result = regenerate(cfg)
    except (DataError, NoConversationsError, FileNotFoundError, ConnectionError) as err:
        print_error(err)
        return 1
    print(summary_text(result))
    if not cfg.regenerate.enabled:
        print(f"  prepare reads it with regenerate.enabled=true (or data.conversations={result.out_dir / 'conversations.jsonl'})")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("regenerate", help="answer every user turn of data.conversations with the target")
    add_config_args(parser)
    parser.add_argument("--limit", type=int, help="regenerate a stable sample of N conversations (regenerate.limit)")
    parser.set_defaults(func=_cmd)
