"""`draftline traffic stats` and `draftline traffic purge`: the traffic store under <data_dir>/traffic."""

from __future__ import annotations

import argparse
import re
import sys
import time

from draftline.cli import add_config_args, config_from_args
from draftline.serving.traffic_store import purge, scan_store, traffic_dir

DURATION_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration_s(text: str) -> float:
    """'90s', '30m', '12h', '7d' -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: use a number and a unit s, m, h or d (e.g. 7d)")
    return float(match.group(1)) * DURATION_UNITS_S[match.group(2)]


def _stats(args: argparse.Namespace) -> int:
    stats = scan_store(traffic_dir(config_from_args(args)))
    print(f"traffic store {stats.directory}: {len(stats.shards)} shard(s), {stats.records} record(s), "
          f"{stats.size_bytes} bytes")
    if stats.shards:
        oldest, newest = stats.shards[0].modified_s, max(s.modified_s for s in stats.shards)
        print(f"last written: oldest shard {_utc(oldest)}, newest {_utc(newest)}")
    for shard in stats.damaged:
        lines = ", ".join(str(n) for n in shard.bad_lines[:10]) + (" ..." if len(shard.bad_lines) > 10 else "")
        print(f"error: {shard.path}: {len(shard.bad_lines)} line(s) fail their checksum (lines {lines}); readers skip "
              "them", file=sys.stderr)
    return 1 if stats.damaged else 0


def _purge(args: argparse.Namespace) -> int:
    directory = traffic_dir(config_from_args(args))
    deleted = purge(directory, None if args.all else args.older_than)
    what = "every shard" if args.all else f"shards last written over {args.older_than:g} s ago"
    print(f"deleted {len(deleted)} shard(s) from {directory} ({what})")
    for path in deleted:
        print(f"  {path.name}")
    return 0


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("traffic", help="inspect or purge captured serving traffic (docs/traffic.md)",
                                   description=__doc__)
    actions = parser.add_subparsers(dest="traffic_action", required=True)
    stats = actions.add_parser("stats", help="shards, records and size of the store; exit 1 if a checksum fails")
    add_config_args(stats)
    stats.set_defaults(func=_stats)
    purge_parser = actions.add_parser("purge", help="delete shards by age, or all of them")
    which = purge_parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--older-than", type=parse_duration_s, metavar="DURATION",
                       help="delete shards last written longer ago than this (e.g. 7d, 12h, 30m)")
    which.add_argument("--all", action="store_true", help="delete every shard")
    add_config_args(purge_parser)
    purge_parser.set_defaults(func=_purge)
