"""The engines' own source, fetched with pip into the repo's .whl/ (git-ignored), so tests run their real code."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIR = REPO / ".whl"


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
