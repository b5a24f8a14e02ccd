"""SGLang's own argument handling, asked directly: the release's interpreter runs `sglang_probe.py` on launch commands.

The interpreters are built by `scripts/setup_sglang_venv.sh` (`make sglang`) under `$DRAFTLINE_SGLANG_ROOT`
(default: `.sglang/` in the working directory, else in the draftline checkout): one venv, and per release a
`releases/<version>/` directory put first on PYTHONPATH.

Each command runs on a scratch copy of its models: a directory holding only the model's `config.json` (target and
draft), so SGLang reads exactly what it would read before loading weights, and nothing else. A path that is not a
local model directory is passed unchanged (SGLang's own error for it is the verdict). `--device cpu` is appended
unless the command sets `--device`: SGLang then takes its CPU defaults where it derives one from the device.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from draftline.engines.sglang.args import FlagTable, read_argv, split_command, strip_launcher

PROBE = Path(__file__).with_name("sglang_probe.py")
CHECKOUT_ROOT = Path(__file__).resolve().parents[4]
MODEL_DESTS = ("model_path", "speculative_draft_model_path")
PHASES = {
    "parse": "argument parsing (argparse)",
    "server-args": "ServerArgs resolution",
    "check-server-args": "ServerArgs.check_server_args",
}


def sglang_root() -> Path:
    configured = os.environ.get("DRAFTLINE_SGLANG_ROOT")
    if configured:
        return Path(configured)
    local = Path.cwd() / ".sglang"
    return local if local.is_dir() else CHECKOUT_ROOT / ".sglang"


@dataclass(frozen=True)
class Installation:
    version: str
    python: Path
    pythonpath: Path


def find_installation(version: str, root: Path | None = None) -> Optional[Installation]:
    root = root or sglang_root()
    release = root / "releases" / version
    python = root / "venv" / "bin" / "python"
    if (release / ".installed").exists() and python.exists():
        return Installation(version, python, release)
    return None


def installed_versions(root: Path | None = None) -> list[str]:
    root = root or sglang_root()
    return sorted(p.parent.name for p in (root / "releases").glob("*/.installed")) if (root / "releases").is_dir() else []


@dataclass(frozen=True)
class Rejection:
    """What SGLang raised for one command."""

    phase: str  # a key of PHASES
    type: str
    message: str
    where: Optional[str]  # file:line inside the sglang package
    source: Optional[str]  # that line of SGLang's source


@dataclass(frozen=True)
class RealReport:
    version: str
    options: list[str]
    shimmed: list[str]
    results: list[Optional[Rejection]]  # None: SGLang accepted the command


def _scratch_argv(argv: list[str], table: FlagTable, scratch: Path, index: int) -> tuple[list[str], dict[str, str]]:
    """argv with local model directories replaced by config.json-only copies; {scratch path: original}."""
    parsed = read_argv(argv, table)
    rewritten = list(parsed.argv)
    originals: dict[str, str] = {}
    for dest in MODEL_DESTS:
        for item in parsed.given(dest):
            if not item.values:
                continue
            config = Path(item.values[0]).expanduser() / "config.json"
            if not config.is_file():
                continue
            copy = scratch / f"{index}-{dest}"
            copy.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(config, copy / "config.json")
            originals[str(copy)] = item.values[0]
            if item.inline_value:
                rewritten[item.position] = f"{item.option}={copy}"
            else:
                rewritten[item.position + 1] = str(copy)
    if not parsed.given("device"):
        rewritten += ["--device", "cpu"]
    return rewritten, originals


def run_sglang_checks(
    argvs: list[list[str] | str], installation: Installation, table: FlagTable, timeout_s: float = 900
) -> RealReport:
    """SGLang's verdict on each command, from one process of the release's interpreter."""
    with tempfile.TemporaryDirectory(prefix="draftline-sglang-") as tmp:
        scratch = Path(tmp)
        prepared = [_scratch_argv(strip_launcher(split_command(a))[1], table, scratch, i) for i, a in enumerate(argvs)]
        env = {**os.environ, "PYTHONPATH": str(installation.pythonpath), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.run(
            [str(installation.python), str(PROBE)],
            input=json.dumps({"argvs": [argv for argv, _ in prepared]}),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=tmp,
        )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(
            f"SGLang {installation.version} ({installation.pythonpath}) could not be run (exit {proc.returncode}):\n"
            + proc.stderr[-3000:]
        )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    results: list[Optional[Rejection]] = []
    for (_, originals), raw in zip(prepared, report["results"]):
        if raw is None:
            results.append(None)
            continue
        message = raw["message"]
        for copy, original in originals.items():
            message = message.replace(copy, original)
        results.append(Rejection(raw["phase"], raw["type"], message, raw["where"], raw["source"]))
    return RealReport(report["version"], report["options"], report["shimmed"], results)
