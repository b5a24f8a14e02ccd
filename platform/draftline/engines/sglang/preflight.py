"""SGLang launch preflight: every problem in a launch command, found before anything starts.

    findings = preflight(["python", "-m", "sglang.launch_server", "--model-path", ...], version="0.5.23")

Each `Finding(level="error"|"warning", rule, flags, message, fix)` names the flags, says why SGLang would
fail or silently change something, and what to write instead. Errors mean SGLang would not start (or would
serve the wrong model); warnings mean it starts but not as written. The rules and the per-version table
they use are in `rules.py`; the known flags per version are data in `flags/<version>.json`.

`preflight_report(..., sglang="auto")` also runs that release's own argument code (real.py), when installed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from draftline.engines.sglang.args import flag_table_for, parse_version, read_argv
from draftline.engines.sglang.real import PHASES, Rejection, find_installation, run_sglang_checks, sglang_root
from draftline.engines.sglang.rules import SERVER_ARGS_PHASES, Context, Finding, MeasuredChain, behaviour_for, run_rules

__all__ = [
    "Finding",
    "MeasuredChain",
    "PreflightError",
    "preflight",
    "preflight_report",
    "PreflightReport",
    "has_errors",
    "format_findings",
]


class PreflightError(ValueError):
    """A generated or given SGLang command that would fail; carries every finding."""

    def __init__(self, findings: list[Finding], argv: list[str]):
        self.findings = findings
        self.argv = argv
        super().__init__("SGLang launch preflight failed:\n" + format_findings(findings))


def _version_findings(version: str, table_version: str) -> list[Finding]:
    """A warning for a version without a flag table of its own (every release on PyPI from 0.5.6 has one)."""
    if table_version == version:
        return []
    row = behaviour_for(version)
    return [
        Finding(
            "warning", "unchecked-version", (), f"SGLang {version} has no flag table of its own; its flags are taken "
            f"from release {table_version} and its rules from the generation read on {row.checked_version}.",
            f"run scripts/setup_sglang_venv.sh {version} and scripts/gen_sglang_flags.py .sglang/wheels/sglang-{version}-*.whl",
        )  # fmt: skip
    ]


@dataclass
class PreflightReport:
    findings: list[Finding]
    applied: str  # which release's flag table and rules were used, and whether SGLang itself was asked


def _sglang_flags(rejection: Rejection, ctx: Context) -> tuple[str, ...]:
    """The options an SGLang exception is about: option strings in its message, field names in it or its statement."""
    text = f"{rejection.message} {rejection.source or ''}"
    found: list[str] = []
    for option in re.findall(r"--[a-z0-9][a-z0-9-]*", rejection.message):
        if option in ctx.table.flags and option not in found:
            found.append(option)
    dests = {spec.dest for spec in ctx.table.flags.values()}
    for name in re.findall(r"[a-z][a-z0-9_]+", text):
        if name in dests and (option := ctx.opt(name)) not in found:
            found.append(option)
    given = [option for option in found if ctx.parsed.given(ctx.table.flags[option].dest if option in ctx.table.flags else "")]
    return tuple(given or found)


def _own_finding(rejection: Rejection, ctx: Context, rule_errors: list[Finding]) -> tuple[Finding, Optional[Finding]]:
    """SGLang's exception as a finding; the fix comes from the rule that predicted it, when one did."""
    flags = _sglang_flags(rejection, ctx)
    phase = "parse" if rejection.phase == "parse" else "server-args"
    predicted = [f for f in rule_errors if f.phase == phase]
    match = next((f for f in predicted if set(f.flags) & set(flags)), predicted[0] if predicted else None)
    what = f"{rejection.type}: {rejection.message}" if rejection.message else rejection.type
    statement = f" (`{rejection.source}`)" if rejection.source and rejection.type == "AssertionError" else ""
    message = f"SGLang {ctx.version} itself rejects this command in {PHASES[rejection.phase]}: {what}{statement}"
    if match is not None:
        message += f". {match.message}"
    fix = match.fix if match else f"change {', '.join(flags) or 'the arguments'} as SGLang's message says (see `sglang serve --help`)"
    return Finding("error", "sglang", flags or (match.flags if match else ()), message, fix, phase, rejection.where), match


def preflight_report(
    argv: list[str] | str, version: str = "0.5.23", *, check_checkpoints: bool = True, sglang: str = "never",
    measured: Optional[MeasuredChain] = None,
) -> PreflightReport:
    """All findings for an SGLang launch argv (with or without `python -m sglang.launch_server` in front).

    `check_checkpoints` reads config.json / safetensors headers of local --model-path and
    --speculative-draft-model-path directories (never tensors). `sglang`: "never" (the rule table only),
    "auto" (also run that release's own argument checks when it is installed, see real.py), "required" (an error
    when it is not installed). SGLang's verdict replaces the rule table's for the phases it runs (parsing and
    ServerArgs); the rule table still reports what fails after ServerArgs (loading, the first draft step).
    `measured`: the drafter's measured speculative settings, which fixes that write a chain then propose.
    """
    parse_version(version)  # a clear ValueError for a malformed version, before anything else
    table = flag_table_for(version)
    parsed = read_argv(argv, table)
    behaviour = behaviour_for(version)
    ctx = Context(parsed=parsed, table=table, version=version, behaviour=behaviour, check_checkpoints=check_checkpoints,
                  measured=measured)
    findings = _version_findings(version, table.version) + run_rules(ctx)
    applied = (
        f"SGLang {version}: flags of release {table.version} (flags/{table.version}.json), rules of "
        f"{behaviour.first_version}{' up to ' + behaviour.before_version if behaviour.before_version else '+'} "
        f"(read from {behaviour.checked_version})"
    )
    if sglang != "never":
        installation = find_installation(version)
        target = parsed.value("model_path")
        if installation is None:
            note = f"not installed (scripts/setup_sglang_venv.sh {version})"
            if sglang == "required":
                findings.append(Finding("error", "sglang-not-installed", (), f"SGLang {version} is not installed under {sglang_root()}", f"run scripts/setup_sglang_venv.sh {version}"))
        elif target is None or not (Path(target).expanduser() / "config.json").is_file():
            note = f"not run: they need the target's config.json and --model-path {target!r} is not a local model directory"
        else:
            rejection = run_sglang_checks([argv], installation, table).results[0]
            own_phase_errors = [f for f in findings if f.level == "error" and f.phase in SERVER_ARGS_PHASES]
            findings = [f for f in findings if f not in own_phase_errors]
            if rejection is None:
                note = "ran: accepted by prepare_server_args and check_server_args"
            else:
                own, matched = _own_finding(rejection, ctx, own_phase_errors)
                findings = [own] + [f for f in own_phase_errors if f is not matched] + findings
                note = f"ran: rejected in {PHASES[rejection.phase]}"
        applied += f"; SGLang's own checks: {note}"
    # Errors first, then in rule-table order (stable sort keeps it).
    return PreflightReport(sorted(findings, key=lambda f: f.level != "error"), applied)


def preflight(argv: list[str] | str, version: str = "0.5.23", *, check_checkpoints: bool = True, sglang: str = "never",
              measured: Optional[MeasuredChain] = None) -> list[Finding]:
    """The findings of `preflight_report`."""
    return preflight_report(argv, version, check_checkpoints=check_checkpoints, sglang=sglang, measured=measured).findings


def has_errors(findings: list[Finding]) -> bool:
    return any(f.level == "error" for f in findings)


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "ok: no problems found"
    errors = sum(f.level == "error" for f in findings)
    lines = [str(f) for f in findings]
    lines.append(f"{errors} error(s), {len(findings) - errors} warning(s)")
    return "\n".join(lines)
