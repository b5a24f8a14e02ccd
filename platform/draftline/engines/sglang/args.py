"""SGLang launch arguments: the known-flag tables and an argv reader that mirrors argparse (the generator of a
launch command is launch.py, above the preflight that checks it).

The flag tables in `flags/<version>.json` are data generated from each SGLang wheel by
`scripts/gen_sglang_flags.py` (which reads `sglang/srt/server_args.py`, and from 0.5.23 on the
`sglang/srt/arg_groups/fields/*.py` namespaces, with `ast`; SGLang is never imported for this).

`read_argv` splits a launch command the way SGLang's argparse parser would (exact option strings,
`--flag=value`, nargs), but never stops at the first problem: it records unknown options, missing values
and stray positionals so the preflight can report all of them at once.
"""

from __future__ import annotations

import functools
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

FLAGS_DIR = Path(__file__).parent / "flags"

# How the launch module may be spelled before the options (stripped before reading the options).
LAUNCH_MODULES = ("sglang.launch_server", "sglang.srt.server", "sglang.launch_server.py")


def parse_version(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.strip().lstrip("v").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise ValueError(f"SGLang version {version!r} is not of the form MAJOR.MINOR.PATCH (e.g. 0.5.23)")
    return tuple(parts)


def version_in(version: str, first: str, before: Optional[str]) -> bool:
    """first <= version < before (before None: no upper end), compared as SGLang release numbers."""
    v = parse_version(version)
    return parse_version(first) <= v and (before is None or v < parse_version(before))


@dataclass(frozen=True)
class FlagSpec:
    """One option string of SGLang's launch parser (see flags/<version>.json)."""

    option: str
    dest: str
    nargs: int | str  # 0, 1, or argparse's "?", "*", "+"
    type: Optional[str]
    choices: Optional[tuple]
    default: object
    required: bool
    deprecated: bool
    replacement: Optional[str]
    canonical: str


@dataclass(frozen=True)
class FlagTable:
    version: str
    path: Path
    generated_from: str
    flags: dict[str, FlagSpec]

    def options_for(self, dest: str) -> list[str]:
        return sorted(option for option, spec in self.flags.items() if spec.dest == dest)

    def canonical(self, dest: str) -> str:
        """The option SGLang documents for a dest (e.g. --speculative-draft-model-path)."""
        for spec in self.flags.values():
            if spec.dest == dest:
                return spec.canonical
        return "--" + dest.replace("_", "-")

    def abbreviation_of(self, option: str) -> list[str]:
        """Known options that argparse (allow_abbrev=True) would accept `option` as a prefix of."""
        if not option.startswith("--") or len(option) < 3:
            return []
        return sorted(known for known in self.flags if known.startswith(option) and known != option)


def available_flag_versions() -> list[str]:
    return sorted((p.stem for p in FLAGS_DIR.glob("*.json")), key=parse_version)


@functools.lru_cache(maxsize=None)
def _load_table(version: str) -> FlagTable:
    path = FLAGS_DIR / f"{version}.json"
    data = json.loads(path.read_text())
    flags = {
        option: FlagSpec(
            option=option,
            dest=entry["dest"],
            nargs=entry["nargs"],
            type=entry.get("type"),
            choices=tuple(entry["choices"]) if entry.get("choices") is not None else None,
            default=entry.get("default"),
            required=bool(entry.get("required")),
            deprecated=bool(entry.get("deprecated")),
            replacement=entry.get("replacement"),
            canonical=entry.get("canonical", option),
        )
        for option, entry in data["flags"].items()
    }
    return FlagTable(version=data["sglang_version"], path=path, generated_from=data["generated_from"], flags=flags)


def flag_table_for(version: str) -> FlagTable:
    """The table for `version`, or the nearest generated version below it (the oldest if none is below)."""
    wanted = parse_version(version)
    versions = available_flag_versions()
    if not versions:
        raise FileNotFoundError(f"no SGLang flag tables in {FLAGS_DIR}; run scripts/gen_sglang_flags.py on a wheel")
    at_or_below = [v for v in versions if parse_version(v) <= wanted]
    return _load_table(at_or_below[-1] if at_or_below else versions[0])


@dataclass
class ArgvItem:
    """One option as written, with the values argparse would give it."""

    option: str  # as written (without any "=value")
    values: list[str]
    position: int  # index of the option in the stripped argv
    spec: Optional[FlagSpec]
    missing_value: bool = False  # the option needs a value and none followed
    inline_value: bool = False  # written as --flag=value
    abbreviates: Optional[str] = None  # the full option argparse expands this prefix to


    @property
    def dest(self) -> Optional[str]:
        return self.spec.dest if self.spec else None

    def as_written(self) -> str:
        if self.inline_value:
            return f"{self.option}={self.values[0]}"
        return " ".join([self.option, *self.values])


@dataclass
class ParsedArgv:
    argv: list[str]  # options only (launcher prefix removed)
    launcher: list[str]
    table: FlagTable
    items: list[ArgvItem] = field(default_factory=list)
    positionals: list[tuple[int, str]] = field(default_factory=list)

    def given(self, dest: str) -> list[ArgvItem]:
        return [item for item in self.items if item.dest == dest]

    def last(self, dest: str) -> Optional[ArgvItem]:
        found = self.given(dest)
        return found[-1] if found else None

    def value(self, dest: str) -> Optional[str]:
        """The value argparse would store (last occurrence wins); None when absent or valueless."""
        item = self.last(dest)
        if item is None or not item.values:
            return None
        return item.values[0]

    def flag_set(self, dest: str) -> bool:
        """For store_true style options: given at all (and not negated with --no-...)."""
        item = self.last(dest)
        return item is not None and not item.option.startswith("--no-")

    def option_name(self, dest: str) -> str:
        """The spelling the user wrote for dest, or SGLang's canonical spelling."""
        item = self.last(dest)
        return item.option if item else self.table.canonical(dest)


def split_command(argv: list[str] | str) -> list[str]:
    """Accept a list, or one shell-quoted string (as users paste commands)."""
    if isinstance(argv, str):
        return shlex.split(argv)
    if len(argv) == 1 and " " in argv[0].strip():
        return shlex.split(argv[0])
    return list(argv)


def strip_launcher(argv: list[str]) -> tuple[list[str], list[str]]:
    """Remove `ENV=1 python -m sglang.launch_server` / `sglang serve` in front of the options."""
    rest = list(argv)
    launcher: list[str] = []
    while rest and "=" in rest[0] and not rest[0].startswith("-"):
        launcher.append(rest.pop(0))
    if rest and Path(rest[0]).name.startswith("python"):
        launcher.append(rest.pop(0))
        if len(rest) >= 2 and rest[0] == "-m":
            launcher += [rest.pop(0), rest.pop(0)]
    elif rest and Path(rest[0]).name == "sglang":
        launcher.append(rest.pop(0))
        if rest and rest[0] == "serve":
            launcher.append(rest.pop(0))
    elif rest and rest[0] in LAUNCH_MODULES:
        launcher.append(rest.pop(0))
    return launcher, rest


def _looks_like_option(token: str) -> bool:
    """argparse treats '-x'/'--x' as an option unless it is a negative number."""
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
        return False
    except ValueError:
        return True


def read_argv(argv: list[str] | str, table: FlagTable) -> ParsedArgv:
    launcher, rest = strip_launcher(split_command(argv))
    parsed = ParsedArgv(argv=rest, launcher=launcher, table=table)
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "--":
            parsed.positionals += [(j, t) for j, t in enumerate(rest[i + 1 :], start=i + 1)]
            break
        if not _looks_like_option(token):
            parsed.positionals.append((i, token))
            i += 1
            continue
        option, has_inline, inline = token.partition("=")
        spec = table.flags.get(option)
        expansions = table.abbreviation_of(option) if spec is None else []
        if len(expansions) == 1:  # argparse's allow_abbrev: a unique prefix stands for the full option
            spec = table.flags[expansions[0]]
        item = ArgvItem(
            option=option,
            values=[inline] if has_inline else [],
            position=i,
            spec=spec,
            inline_value=bool(has_inline),
            abbreviates=expansions[0] if len(expansions) == 1 else None,
        )
        i += 1
        if has_inline:
            parsed.items.append(item)
            continue
        nargs = spec.nargs if spec else "?"  # unknown option: take one following value if there is one
        if nargs == 0:
            pass
        elif nargs in (1, "?"):
            if i < len(rest) and not _looks_like_option(rest[i]):
                item.values.append(rest[i])
                i += 1
            elif nargs == 1:
                item.missing_value = True
        elif nargs in ("*", "+"):
            while i < len(rest) and not _looks_like_option(rest[i]):
                item.values.append(rest[i])
                i += 1
            item.missing_value = nargs == "+" and not item.values
        elif isinstance(nargs, int):
            while len(item.values) < nargs and i < len(rest) and not _looks_like_option(rest[i]):
                item.values.append(rest[i])
                i += 1
            item.missing_value = len(item.values) < nargs
        parsed.items.append(item)
    return parsed
