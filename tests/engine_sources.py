"""The engines' and peer tools' own source (SGLang wheels fetched into .whl/, speculators and SpecForge built into
.peers/ by `make peers`; both git-ignored), so tests run their real code."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIR = REPO / ".whl"
# vLLM's CPU build (`make setup-vllm`).
VLLM_PYTHON = os.environ.get("DRAFTLINE_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
# The peer tools' overlays (scripts/setup_peer_envs.sh, `make peers`): run by this interpreter with PYTHONPATH=ROOT/NAME.
PEERS_ROOT = Path(os.environ.get("DRAFTLINE_PEERS_ROOT", str(REPO / ".peers")))


def peer_env(name: str) -> dict[str, str]:
    """The environment that runs a peer tool's own code (speculators, specforge) from its overlay."""
    overlay = PEERS_ROOT / name
    if not (overlay / ".installed").is_file():
        raise FileNotFoundError(f"{overlay} is not built: run `make peers` (scripts/setup_peer_envs.sh)")
    # Compiled paths (torch.compile on their rotary/forward) need a C++ toolchain at first call; the maths is the same eager.
    return {**os.environ, "PYTHONPATH": str(overlay), "TORCHDYNAMO_DISABLE": "1"}


def sglang_wheel(version: str) -> Path:
    target = WHEEL_DIR / f"sglang-{version}"
    wheels = sorted(target.glob("sglang-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"sglang=={version}", "-d", str(target)],
            check=True, timeout=600,
        )  # fmt: skip
        wheels = sorted(target.glob("sglang-*.whl"))
    return wheels[0]


def unpacked_sglang_sources(version: str, prefixes: tuple[str, ...]) -> Path:
    """The wheel's files under `prefixes`, unpacked into .whl/sglang-<version>/src (once), for code run by path."""
    dest = WHEEL_DIR / f"sglang-{version}" / "src"
    marker = dest / ".unpacked"
    if not marker.exists() or marker.read_text() != "\n".join(prefixes):
        with zipfile.ZipFile(sglang_wheel(version)) as archive:
            archive.extractall(dest, members=[n for n in archive.namelist() if n.startswith(prefixes)])
        marker.write_text("\n".join(prefixes))
    return dest


def read_wheel_file(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(member).decode()


def method_from_source(source: str, class_name: str, method_name: str, namespace: dict | None = None) -> Callable:
    """Compile one method of a class, exactly as written in `source`, into a plain function."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method_name:
                    module = ast.Module(body=[item], type_ignores=[])
                    scope = dict(namespace or {})
                    exec(compile(module, f"<{class_name}.{method_name}>", "exec"), scope)
                    return scope[method_name]
    raise LookupError(f"{class_name}.{method_name} not found")
