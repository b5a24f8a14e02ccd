"""`draftline export`: turn a drafter training checkpoint into an HF directory (SGLang, vLLM, SpecForge) or a
checkpoint in speculators' own format (--format speculators)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftline.drafter.export import (
    CHECKPOINT_CONFIG_FILE,
    CHECKPOINT_STATE_FILE,
    export_drafter,
    load_drafter_checkpoint,
)
from draftline.drafter.speculators_export import export_speculators
from draftline.utils import read_json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a drafter checkpoint for SGLang/vLLM/SpecForge (LlamaForCausalLMEagle3) or speculators",
        description=__doc__,
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help=f"checkpoint directory holding {CHECKPOINT_STATE_FILE} and {CHECKPOINT_CONFIG_FILE}",
    )
    parser.add_argument(
        "--out", required=True, help="export directory (config.json, model.safetensors, draftline.json)"
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="weight dtype (default: as trained)"
    )
    parser.add_argument(
        "--format",
        choices=["hf", "speculators"],
        default="hf",
        help="hf: the LlamaForCausalLMEagle3 directory SGLang, vLLM and SpecForge load; speculators: speculators' "
        "Eagle3SpeculatorConfig checkpoint (vLLM serves it too), which needs --verifier",
    )
    parser.add_argument(
        "--verifier",
        default=None,
        help="speculators format: the target the drafter serves, written as speculators_config.verifier.name_or_path "
        "(a directory holding its config.json, or a hub id with --verifier-config)",
    )
    parser.add_argument(
        "--verifier-config",
        default=None,
        help="speculators format: the target's config.json or its directory (default: --verifier); its layer count "
        "bounds the aux ids, its architectures are recorded",
    )
    parser.add_argument(
        "--meta", default=None, help="JSON file merged into draftline.json (target fingerprint, dataset hash, metrics)"
    )
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    meta = None
    if args.meta:
        try:
            meta = json.loads(Path(args.meta).read_text())
        except (OSError, json.JSONDecodeError) as err:
            print(f"error: --meta {args.meta}: cannot read a JSON object ({err})", file=sys.stderr)
            return 2
        if not isinstance(meta, dict):
            print(f"error: --meta {args.meta}: expected a JSON object, got {type(meta).__name__}", file=sys.stderr)
            return 2
    try:
        model = load_drafter_checkpoint(args.checkpoint)
        if args.format == "hf":
            out = export_drafter(model, args.out, meta=meta, dtype=args.dtype)
        else:
            verifier_config = _verifier_config(args)
            out = export_speculators(model, args.out, args.verifier, verifier_config, meta=meta, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: export: {err}", file=sys.stderr)
        return 2
    print(f"exported drafter to {out} ({args.format} format)")
    return 0


def _verifier_config(args: argparse.Namespace) -> dict:
    """The target's config.json for --format speculators (ValueError / FileNotFoundError naming the flag)."""
    if not args.verifier:
        raise ValueError("--format speculators needs --verifier (the target's directory or hub id)")
    path = Path(args.verifier_config or args.verifier)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"--verifier-config (default --verifier) {path}: no such config.json; name the target's config.json or its "
            "directory (for a hub id in --verifier, pass a local copy of its config.json)"
        )
    return read_json(path)
