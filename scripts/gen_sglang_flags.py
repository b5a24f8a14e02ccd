#!/usr/bin/env python3
"""Regenerate draftline's list of SGLang launch flags from an SGLang wheel, without importing SGLang.

    python scripts/gen_sglang_flags.py /tmp/sgl/0.5.23/sglang-0.5.23-*.whl
    python scripts/gen_sglang_flags.py WHEEL [--version 0.5.23] [--out-dir platform/draftline/engines/sglang/flags]

It reads `sglang/srt/server_args.py` out of the wheel (a zip) and walks its syntax tree:
- every `parser.add_argument("--flag", ...)` call (how 0.5.6 and 0.5.12 declare all flags, and how 0.5.23
  declares the few flags with dynamic choices or deprecated spellings);
- from 0.5.14 on, the dataclass-style fields `name: A[type, "help"]` / `A[type, Arg(...)]` of the namespace
  class `ServerArgs` itself (0.5.14-0.5.19) or of the namespace classes listed in `_INPUT_NAMESPACES` (0.5.20 on, in
  `sglang/srt/arg_groups/fields/*.py`), turned into flags the way
  `add_cli_args_from_dataclass` does (`--field-name`, `cli_name=`, `aliases=`, `no_cli=`, bool -> store_true,
  `Literal[...]` -> choices, `list[...]` -> nargs "+", `argparse.BooleanOptionalAction` -> also `--no-...`).
The output is data: one JSON file per version (`<version>.json`) mapping each option string to how many
values it takes, its choices (when they are literal lists), its literal default and whether it is deprecated.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from pathlib import Path

SERVER_ARGS = "sglang/srt/server_args.py"
FIELDS_DIR = "sglang/srt/arg_groups/fields/"
CHOICES_MODULE = "sglang/srt/arg_groups/choices.py"
DEFAULT_OUT_DIR = Path(__file__).resolve().parents[1] / "platform/draftline/engines/sglang/flags"

# argparse actions that consume no value on the command line.
ZERO_VALUE_ACTIONS = {"store_true", "store_false", "store_const", "count", "help", "version", "BooleanOptionalAction"}


def literal(node: ast.AST | None, symbols: dict[str, ast.AST]):
    """Best-effort literal value of an expression; `...` (Ellipsis) when it is not a plain literal."""
    if node is None:
        return ...
    if isinstance(node, ast.Name) and node.id in symbols:
        return literal(symbols[node.id], symbols)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = literal(node.left, symbols), literal(node.right, symbols)
        if isinstance(left, (list, str)) and type(left) is type(right):
            return left + right
        return ...
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("list", "sorted"):
        inner = literal(node.args[0], symbols) if node.args else ...
        return sorted(inner) if isinstance(inner, list) and node.func.id == "sorted" else inner
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        # Values that are not literals (e.g. {"type": str}) stay `...`; the keys we look up still resolve.
        return {k.value: literal(v, symbols) for k, v in zip(node.keys, node.values)}
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ...
    if isinstance(value, (set, frozenset)):
        value = sorted(value, key=repr)  # sets have no order; keep the generated file reproducible
    elif isinstance(value, tuple):
        value = list(value)
    return value


def dotted_name(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def module_symbols(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level `NAME = <expr>` assignments (used to resolve choices=NAME)."""
    symbols: dict[str, ast.AST] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    symbols[target.id] = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            symbols[stmt.target.id] = stmt.value
    return symbols


def class_defaults(tree: ast.Module, class_name: str, symbols: dict[str, ast.AST]) -> dict[str, object]:
    """Literal defaults of a dataclass body (0.5.6/0.5.12 write `default=ServerArgs.page_size`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {
                stmt.target.id: literal(stmt.value, symbols)
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None
            }
    return {}


def nargs_for(action: str | None, nargs) -> int | str:
    """How many values an option takes: 0, 1, or argparse's '?', '*', '+'."""
    if nargs is not ... and nargs is not None:
        return nargs
    if action in ZERO_VALUE_ACTIONS:
        return 0
    # SGLang's own Deprecated*Action classes default to nargs=0; the alias-store one keeps the value.
    if action and action.startswith("Deprecated") and action != "DeprecatedAliasStoreAction" and nargs is ...:
        return 0
    return 1


def json_safe(value):
    return None if value is ... else value


def flags_from_add_argument(tree: ast.Module, symbols: dict[str, ast.AST], defaults: dict[str, object]) -> dict:
    flags: dict[str, dict] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        options = [n for n in names if n.startswith("-")]
        if not options:
            continue
        kwargs = {kw.arg: kw.value for kw in node.keywords if kw.arg}
        action = dotted_name(kwargs.get("action"))
        dest = literal(kwargs.get("dest"), symbols)
        if dest is ...:
            dest = options[0].lstrip("-").replace("-", "_")
        default = ...
        if "default" in kwargs:
            default_node = kwargs["default"]
            if isinstance(default_node, ast.Attribute) and isinstance(default_node.value, ast.Name):
                default = defaults.get(default_node.attr, ...)
            else:
                default = literal(default_node, symbols)
        choices = literal(kwargs.get("choices"), symbols) if "choices" in kwargs else None
        entry = {
            "dest": dest,
            "nargs": nargs_for(action, literal(kwargs.get("nargs"), symbols) if "nargs" in kwargs else ...),
            "type": dotted_name(kwargs.get("type")),
            "choices": json_safe(choices) if isinstance(choices, list) or choices is ... else None,
            "default": json_safe(default),
            "required": literal(kwargs.get("required"), symbols) is True,
            "deprecated": bool(action and action.startswith("Deprecated")),
            "replacement": json_safe(literal(kwargs.get("new_flag"), symbols)) if "new_flag" in kwargs else None,
            "action": action,
        }
        for option in options:
            flags[option] = dict(entry, canonical=options[0])
        if action == "BooleanOptionalAction":
            for option in options:
                if option.startswith("--"):
                    flags["--no-" + option[2:]] = dict(entry, canonical=options[0])
    return flags


def unwrap_type(node: ast.AST) -> tuple[str, list | None]:
    """(kind, literal choices) of a field type: kind is bool/int/float/str/list/literal/other."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # string annotation
        node = ast.parse(node.value, mode="eval").body
    if isinstance(node, ast.Subscript):
        head = dotted_name(node.value)
        inner = node.slice
        if head == "Optional":
            return unwrap_type(inner)
        if head == "Union" and isinstance(inner, ast.Tuple):
            non_none = [e for e in inner.elts if not (isinstance(e, ast.Constant) and e.value is None)]
            if len(non_none) == 1:
                return unwrap_type(non_none[0])
            return "other", None
        if head == "Literal":
            values = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            return "literal", [v.value for v in values if isinstance(v, ast.Constant)]
        if head in ("list", "List"):
            return "list", None
        return "other", None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | None
        for side in (node.left, node.right):
            if not (isinstance(side, ast.Constant) and side.value is None):
                return unwrap_type(side)
    name = dotted_name(node)
    if name in ("bool", "int", "float", "str"):
        return name, None
    return "other", None


def flags_from_fields(class_node: ast.ClassDef, symbols: dict[str, ast.AST]) -> dict:
    """Flags of one 0.5.23-style namespace class, following add_cli_args_from_dataclass's rules."""
    flags: dict[str, dict] = {}
    for stmt in class_node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        annotation = stmt.annotation
        if not (isinstance(annotation, ast.Subscript) and dotted_name(annotation.value) in ("A", "Annotated")):
            continue
        parts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        field_type, metadata = parts[0], parts[1:]
        arg_kwargs: dict[str, ast.AST] | None = None
        for meta in metadata:
            if isinstance(meta, ast.Call) and dotted_name(meta.func) == "Arg":
                arg_kwargs = {kw.arg: kw.value for kw in meta.keywords if kw.arg}
                break
            if literal(meta, symbols) is not ... and isinstance(literal(meta, symbols), str):
                arg_kwargs = {}
                break
        if arg_kwargs is None or literal(arg_kwargs.get("no_cli"), symbols) is True:
            continue
        field = stmt.target.id
        cli_name = literal(arg_kwargs.get("cli_name"), symbols)
        cli_name = cli_name if isinstance(cli_name, str) else "--" + field.replace("_", "-")
        aliases = literal(arg_kwargs.get("aliases"), symbols)
        options = [cli_name] + (aliases if isinstance(aliases, list) else [])
        kind, literal_choices = unwrap_type(field_type)
        action = dotted_name(arg_kwargs.get("action"))
        explicit_nargs = literal(arg_kwargs.get("nargs"), symbols) if "nargs" in arg_kwargs else ...
        has_type_parser = "type_parser" in arg_kwargs
        if action is not None:
            action_kwargs = literal(arg_kwargs.get("action_kwargs"), symbols)
            kw_nargs = action_kwargs.get("nargs", ...) if isinstance(action_kwargs, dict) else ...
            nargs = nargs_for(action, kw_nargs)
        elif kind == "bool":
            action, nargs = "store_true", 0
        elif kind == "list" and not has_type_parser:
            nargs = explicit_nargs if explicit_nargs is not ... else "+"
        else:
            nargs = explicit_nargs if explicit_nargs is not ... else 1
        choices = literal(arg_kwargs.get("choices"), symbols) if "choices" in arg_kwargs else literal_choices
        default = literal(stmt.value, symbols) if stmt.value is not None else ...
        required = literal(arg_kwargs.get("required"), symbols)
        entry = {
            "dest": field,
            "nargs": nargs,
            "type": kind if kind in ("int", "float", "str") else ("str" if kind == "literal" else None),
            "choices": choices if isinstance(choices, list) else None,
            "default": json_safe(default),
            "required": required is True or (required is ... and stmt.value is None and nargs != 0),
            "deprecated": bool(action and action.startswith("Deprecated")),
            "replacement": None,
            "action": action,
        }
        for option in options:
            flags[option] = dict(entry, canonical=options[0])
        if action == "BooleanOptionalAction":
            for option in options:
                flags["--no-" + option[2:]] = dict(entry, canonical=options[0])
    return flags


def input_namespace_names(tree: ast.Module) -> list[str]:
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in stmt.targets
        ):
            if isinstance(stmt.value, (ast.List, ast.Tuple)):
                return [dotted_name(e) for e in stmt.value.elts if dotted_name(e)]
    return []


def dataclass_cli_classes(tree: ast.Module) -> list[str]:
    """Classes passed to `add_cli_args_from_dataclass(parser, CLS)` in server_args.py."""
    return [
        dotted_name(node.args[1])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and dotted_name(node.func) == "add_cli_args_from_dataclass" and len(node.args) >= 2
    ]


def generate(wheel: Path, version: str | None) -> dict:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        read = lambda name: zf.read(name).decode("utf-8")  # noqa: E731
        if version is None:
            match = re.search(r"sglang-([0-9][^-]*)\.dist-info/METADATA", "\n".join(names))
            if not match:
                raise SystemExit(f"{wheel}: cannot tell the SGLang version; pass --version")
            version = match.group(1)
        server_args_tree = ast.parse(read(SERVER_ARGS))
        symbols = module_symbols(server_args_tree)
        source_files = [SERVER_ARGS]
        if CHOICES_MODULE in names:
            symbols = {**module_symbols(ast.parse(read(CHOICES_MODULE))), **symbols}
            source_files.append(CHOICES_MODULE)
        defaults = class_defaults(server_args_tree, "ServerArgs", symbols)
        flags = {}
        namespaces = input_namespace_names(server_args_tree)
        dataclass_args = dataclass_cli_classes(server_args_tree)
        if dataclass_args and not namespaces:
            # 0.5.14-0.5.19: ServerArgs itself carries the annotated fields (`add_cli_args_from_dataclass(parser, ServerArgs)`).
            for node in server_args_tree.body:
                if isinstance(node, ast.ClassDef) and node.name in dataclass_args:
                    flags.update(flags_from_fields(node, symbols))
        if namespaces:
            classes: dict[str, tuple[ast.ClassDef, dict]] = {}
            for name in sorted(n for n in names if n.startswith(FIELDS_DIR) and n.endswith(".py")):
                tree = ast.parse(read(name))
                module_syms = {**symbols, **module_symbols(tree)}
                for node in tree.body:
                    if isinstance(node, ast.ClassDef) and node.name in namespaces:
                        classes[node.name] = (node, module_syms)
                        if name not in source_files:
                            source_files.append(name)
            missing = [n for n in namespaces if n not in classes]
            if missing:
                raise SystemExit(f"{wheel}: namespace classes {missing} not found under {FIELDS_DIR}")
            for name in namespaces:
                node, module_syms = classes[name]
                flags.update(flags_from_fields(node, module_syms))
        # Explicit add_argument calls come last: argparse would reject a duplicate, so none overlap.
        flags.update(flags_from_add_argument(server_args_tree, symbols, defaults))
    return {
        "sglang_version": version,
        "generated_from": wheel.name,
        "generator": "scripts/gen_sglang_flags.py",
        "source_files": source_files,
        "flags": dict(sorted(flags.items())),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="an SGLang wheel (.whl)")
    parser.add_argument("--version", help="SGLang version (default: read from the wheel's METADATA)")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    if not args.wheel.is_file():
        print(f"error: wheel {args.wheel} not found", file=sys.stderr)
        return 2
    table = generate(args.wheel, args.version)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"{table['sglang_version']}.json"
    out.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    print(f"wrote {out}: {len(table['flags'])} option strings from {', '.join(table['source_files'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
