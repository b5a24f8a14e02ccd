"""`draftline refresh`: the champion trained further on captured traffic, gated, promoted and rolled if it holds."""

from __future__ import annotations

from draftline.cli import add_config_args, config_from_args
from draftline.raycluster import local_ray_stopped_at_the_end
from draftline.refresh.run import load_window, refresh, window_summary


def _cmd(args) -> int:
    cfg = config_from_args(args)
    if args.dry_run:
        print(window_summary(load_window(cfg)))
        return 0
    with local_ray_stopped_at_the_end():
        record = refresh(cfg, promote=not args.no_promote)
    bench = record.bench_gate or "not run"
    print(f"refresh: version {record.version} (from champion {record.champion_version}) held-out traffic gate "
          f"{record.traffic_gate}, original bench gate {bench}; "
          + ("promoted" if record.promoted else "not promoted, champion unchanged"))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "refresh", help="train the champion further on captured traffic; promote only if it beats it (docs/refresh.md)",
        description=__doc__,
    )
    add_config_args(parser)
    parser.add_argument("--no-promote", action="store_true", help="train and gate, but leave the champion as it is")
    parser.add_argument("--dry-run", action="store_true",
                        help="say which traffic a refresh would train and gate on, and stop (nothing is written)")
    parser.set_defaults(func=_cmd)
