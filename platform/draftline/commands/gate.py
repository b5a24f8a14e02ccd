"""`draftline gate`: bench a drafter version against the champion and tag it (draftline.gate)."""

from __future__ import annotations

import argparse
import json

from draftline import gate
from draftline.cli import add_config_args, config_from_args
from draftline.engines import add_engine_arg, with_engine_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "gate", help="bench a drafter version and tag it gate=passed|failed", description=gate.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--version", help="registered version to gate (default: the latest)")
    add_engine_arg(parser)
    add_config_args(parser)
    parser.set_defaults(func=_gate_command)


def _gate_command(args: argparse.Namespace) -> int:
    cfg = with_engine_arg(config_from_args(args), args)
    decision = gate.run_gate(cfg, args.version)  # a RegistryError is cli.main's one line, exit 1
    for check in decision.checks:
        print(f"  [{check.outcome.upper() if not check.passed else 'pass'}] {check.name}: {check.detail}")
    print(f"gate {decision.verdict.upper()} for {cfg.registered_model_name} version {decision.version} after "
          f"{decision.rounds} rounds (MLflow run {decision.run_id})")  # fmt: skip
    print(json.dumps({"version": decision.version, "gate": "passed" if decision.passed else "failed",
                      "verdict": decision.verdict, "rounds": decision.rounds, "reasons": decision.reasons}))  # fmt: skip
    return 0 if decision.passed else 1
