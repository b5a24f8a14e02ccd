"""SGLang launch preflight: every problem in a launch command, found before anything starts.

    findings = preflight(["python", "-m", "sglang.launch_server", "--model-path", ...], version="0.5.23")

Each `Finding(level="error"|"warning", rule, flags, message, fix)` names the flags, says why SGLang would
fail or silently change something, and what to write instead. Errors mean SGLang would not start (or would
serve the wrong model); warnings mean it starts but not as written. The rules and the per-version table
they use are in `rules.py`; the known flags per version are data in `flags/<version>.json`.

`real_parser_check` additionally runs SGLang's own argparse parser (`ServerArgs.add_cli_args`) in an
interpreter that has sglang installed, when one is available.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Optional

from draftline.engines.sglang.args import flag_table_for, parse_version, read_argv, split_command, strip_launcher
from draftline.engines.sglang.rules import VERSION_TABLE, Context, Finding, behaviour_for, run_rules

__all__ = [
    "Finding",
    "PreflightError",
    "preflight",
    "has_errors",
    "format_findings",
    "real_parser_check",
    "real_parser_check_many",
]


class PreflightError(ValueError):
    """A generated or given SGLang command that would fail; carries every finding."""

    def __init__(self, findings: list[Finding], argv: list[str]):
        self.findings = findings
        self.argv = argv
        super().__init__("SGLang launch preflight failed:\n" + format_findings(findings))


def _version_findings(version: str, table_version: str) -> list[Finding]:
    findings = []
    checked = [row.checked_version for row in VERSION_TABLE]
    row = behaviour_for(version)
    if version not in checked:
        newest = checked[-1]
        where = (
            f"newer than the newest checked version {newest}"
            if parse_version(version) > parse_version(newest)
            else f"not one of the checked versions ({', '.join(checked)})"
        )
        findings.append(
            Finding(
                "warning", "unchecked-version", (), f"SGLang {version} is {where}; its rules are taken from "
                f"{row.checked_version} and its flags from the {table_version} table.",
                "check behaviour in that version's server_args.py, add a row to rules.VERSION_TABLE and run "
                "scripts/gen_sglang_flags.py on its wheel",
            )  # fmt: skip
        )
    return findings


def preflight(argv: list[str] | str, version: str = "0.5.23", *, check_checkpoints: bool = True) -> list[Finding]:
    """All findings for an SGLang launch argv (with or without `python -m sglang.launch_server` in front).

    `check_checkpoints` reads config.json / safetensors headers of local --model-path and
    --speculative-draft-model-path directories (never tensors).
    """
    parse_version(version)  # a clear ValueError for a malformed version, before anything else
    table = flag_table_for(version)
    parsed = read_argv(argv, table)
    ctx = Context(parsed=parsed, table=table, version=version, behaviour=behaviour_for(version), check_checkpoints=check_checkpoints)
    findings = _version_findings(version, table.version) + run_rules(ctx)
    # Errors first, then in rule-table order (stable sort keeps it).
    return sorted(findings, key=lambda f: f.level != "error")


def has_errors(findings: list[Finding]) -> bool:
    return any(f.level == "error" for f in findings)


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "ok: no problems found"
    errors = sum(f.level == "error" for f in findings)
    lines = [str(f) for f in findings]
    lines.append(f"{errors} error(s), {len(findings) - errors} warning(s)")
    return "\n".join(lines)


# Runs inside the sglang interpreter: build SGLang's parser once and report what it rejects in each argv, as JSON.
_REAL_PARSER_PROGRAM = r"""
import argparse, json, sys
import sglang
from sglang.srt.server_args import ServerArgs
class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)
parser = Parser(prog="sglang serve")
ServerArgs.add_cli_args(parser)
options = sorted(o for a in parser._actions for o in a.option_strings)
results = []
for argv in json.loads(sys.stdin.read()):
    try:
        _, unknown = parser.parse_known_args(argv)
        error = None
    except ValueError as err:
        unknown, error = [], str(err)
    results.append({"unknown": unknown, "error": error})
print(json.dumps({"version": getattr(sglang, "__version__", None), "options": options, "results": results}))
"""


def real_parser_check_many(argvs: list[list[str] | str], python: str | Path, timeout_s: float = 300) -> dict:
    """Parse each argv with SGLang's own parser in `python` (an interpreter with sglang installed), in one process.

    Returns {"version", "options": [every option string], "results": [{"unknown": [...], "error": str|None}, ...]}.
    Raises RuntimeError (with the interpreter's stderr) when sglang cannot be imported there.
    """
    options_only = [strip_launcher(split_command(argv))[1] for argv in argvs]
    proc = subprocess.run(
        [str(python), "-c", _REAL_PARSER_PROGRAM],
        input=json.dumps(options_only),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{python}: could not run SGLang's parser (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def real_parser_check(argv: list[str] | str, python: str | Path, timeout_s: float = 300) -> dict:
    """One argv: {"version", "options", "unknown": [...], "error": str|None}."""
    report = real_parser_check_many([argv], python, timeout_s)
    return {"version": report["version"], "options": report["options"], **report["results"][0]}


def sglang_version_of(python: str | Path, timeout_s: float = 60) -> Optional[str]:
    """The sglang version installed for an interpreter, from package metadata (no sglang import)."""
    proc = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None
