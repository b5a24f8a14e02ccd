"""`draftline export`: turn a drafter training checkpoint into an SGLang-loadable HF directory."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftline.drafter.export import CHECKPOINT_CONFIG_FILE, CHECKPOINT_STATE_FILE, export_from_checkpoint


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a drafter checkpoint for SGLang (LlamaForCausalLMEagle3)",
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
        out = export_from_checkpoint(args.checkpoint, args.out, meta=meta, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: export: {err}", file=sys.stderr)
        return 2
    print(f"exported drafter to {out}")
    return 0
