"""`draftline sglang-command` and `draftline check-sglang-args`.

    draftline sglang-command --config configs/x.yaml --draft-model-path EXPORT_DIR [--model-path TARGET_DIR]
    draftline sglang-command --config configs/x.yaml --alias champion | --version N [--concurrency C]
        prints the exact SGLang launch command for cfg.engine (checked by the preflight first); for a registry version,
        its files and the speculative settings its bench sweep measured fastest at concurrency C
    draftline check-sglang-args [--sglang-version 0.5.23] [--sglang auto|never|required] -- python -m sglang.launch_server ...
    draftline check-sglang-args --config configs/x.yaml --alias champion | --version N [--concurrency C] -- ...
        checks a hand-written command (with SGLang's own argument code when installed, else the rule table);
        with a registry version, the fixes propose its measured speculative settings;
        exit 0 when clean or only warnings, 1 with errors
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from typing import Optional

from draftline.cli import DEFAULT_CONFIG, add_config_args, config_from_args
from draftline.config import ConfigError, DraftlineConfig, load_config
from draftline.engines.sglang.launch import build_launch_argv
from draftline.engines.sglang.preflight import (
    MeasuredChain, PreflightError, format_findings, has_errors, preflight, preflight_report,
)  # fmt: skip
from draftline.registry import ResolvedVersion, get_version, measured_speculative, resolve_alias
from draftline.target.load import resolve_target_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    command = subparsers.add_parser(
        "sglang-command",
        help="print the SGLang launch command for a config (preflight-checked)",
        description="Print the exact SGLang launch command generated from cfg.engine, after the preflight passes.",
    )
    add_config_args(command)
    command.add_argument("--model-path", help="target model directory (default: target.path, or the embedded target)")
    command.add_argument("--draft-model-path", help="exported drafter directory (`draftline export` output)")
    add_version_args(command)
    command.add_argument("--python", help="interpreter for the command (default: engine.sglang.python)")
    command.add_argument("--json", action="store_true", help="print the argv as a JSON list instead of a shell line")
    command.set_defaults(func=run_sglang_command)

    check = subparsers.add_parser(
        "check-sglang-args",
        help="check a hand-written SGLang launch command before launching it",
        description="Check an SGLang launch command: unknown/vLLM flags, speculative settings, draft vs target "
        "checkpoints. Put the command after `--`. Exit 0: no errors (warnings allowed); 1: errors.",
    )
    check.add_argument("--sglang-version", default="0.5.23", help="SGLang version to check against (default: %(default)s)")
    check.add_argument(
        "--sglang",
        choices=("auto", "never", "required"),
        default="auto",
        help="run that release's own argument checks (prepare_server_args, check_server_args) when `make sglang` "
        "installed it: auto (default), never (rule table only), required (an error when it is not installed)",
    )
    check.add_argument("--no-checkpoints", action="store_true", help="do not read config.json / safetensors headers")
    check.add_argument("--config", "-c", default=DEFAULT_CONFIG,
                       help="config whose MLflow registry holds --version/--alias (default: %(default)s)")
    add_version_args(check)
    check.add_argument("--json", action="store_true", help="print findings as JSON")
    check.add_argument("launch_argv", nargs=argparse.REMAINDER, help="the SGLang command, after `--`")
    check.set_defaults(func=run_check_sglang_args)


def add_version_args(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--version", help="a registered drafter version: its files, and its measured speculative settings")
    which.add_argument("--alias", help="a registry alias (e.g. champion), as --version")
    parser.add_argument("--concurrency", type=int, help="the concurrency to take the measured settings at "
                        "(default: serve.max_ongoing_requests, what one serving replica runs)")


def registry_version(cfg: DraftlineConfig, args: argparse.Namespace) -> Optional[ResolvedVersion]:
    if args.version:
        return get_version(cfg, args.version)
    if args.alias:
        return resolve_alias(cfg, args.alias)
    return None


def measured_chain(cfg: DraftlineConfig, resolved: ResolvedVersion, concurrency: Optional[int]) -> Optional[MeasuredChain]:
    """The settings `draftline bench --sweep` stored on the version as fastest at `concurrency`, or None (with a note
    on stderr saying so and how to measure them)."""
    level = concurrency or cfg.serve.max_ongoing_requests
    spec = measured_speculative(resolved, level, cfg.engine.speculative)
    if spec is None:
        print(f"note: model {resolved.name} version {resolved.version} has no stored bench sweep, so nothing is measured "
              f"to propose; `draftline bench --sweep --version {resolved.version}` measures it", file=sys.stderr)
        return None
    source = (f"measured fastest for model {resolved.name} version {resolved.version} at concurrency {level} "
              "by `draftline bench --sweep`")
    return MeasuredChain(spec, source)


def _target_path(cfg, explicit: str | None) -> str:
    if explicit:
        return explicit
    if cfg.target.kind == "hf":
        return cfg.target.path

    return str(resolve_target_dir(cfg))


def run_sglang_command(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    draft_model_path = args.draft_model_path
    resolved = registry_version(cfg, args)
    if resolved is not None:
        if draft_model_path:
            raise ConfigError("give the drafter once: --draft-model-path EXPORT_DIR or --version/--alias, not both")
        draft_model_path = str(resolved.export_dir)
        chain = measured_chain(cfg, resolved, args.concurrency)
        if chain is not None:
            spec = chain.speculative
            cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"speculative": spec})})
            print(f"note: speculative settings {spec.num_steps}/{spec.eagle_topk}/{spec.num_draft_tokens} "
                  f"{chain.source}", file=sys.stderr)
    if cfg.engine.speculative.algorithm and not draft_model_path:
        raise ConfigError(
            f"engine.speculative.algorithm is {cfg.engine.speculative.algorithm!r} but no draft model was given: "
            "pass --draft-model-path EXPORT_DIR (a `draftline export` directory) or --version N / --alias champion"
        )
    try:
        argv = build_launch_argv(
            cfg, _target_path(cfg, args.model_path), draft_model_path, python=args.python
        )
    except PreflightError as err:
        print(f"error: the launch command generated from {args.config} would fail:", file=sys.stderr)
        print(format_findings(err.findings), file=sys.stderr)
        print("command: " + shlex.join(err.argv), file=sys.stderr)
        return 1
    warnings = [f for f in preflight(argv, cfg.engine.sglang.version) if f.level == "warning"]
    if warnings:
        print(format_findings(warnings), file=sys.stderr)
    print(json.dumps(argv) if args.json else shlex.join(argv))
    return 0


def run_check_sglang_args(args: argparse.Namespace) -> int:
    launch = list(args.launch_argv)
    if launch and launch[0] == "--":
        launch = launch[1:]
    if not launch:
        print("error: nothing to check; put the SGLang command after `--`, e.g.\n"
              "  draftline check-sglang-args -- python -m sglang.launch_server --model-path DIR ...", file=sys.stderr)  # fmt: skip
        return 2
    chain = None
    if args.version or args.alias:
        cfg = load_config(args.config, [])
        chain = measured_chain(cfg, registry_version(cfg, args), args.concurrency)
    report = preflight_report(launch, args.sglang_version, check_checkpoints=not args.no_checkpoints, sglang=args.sglang,
                              measured=chain)
    if args.json:
        print(json.dumps({"applied": report.applied, "findings": [asdict(f) for f in report.findings]}, indent=1))
    else:
        print(report.applied)
        print(format_findings(report.findings))
    return 1 if has_errors(report.findings) else 0
