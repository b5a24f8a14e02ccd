"""Run SGLang's own argument handling on launch commands; runs INSIDE an interpreter that has sglang (stdlib only).

    PYTHONPATH=.sglang/releases/0.5.23 .sglang/venv/bin/python sglang_probe.py < {"argvs": [[...], ...]}

For each argv it does what `sglang serve` / `python -m sglang.launch_server` does before any model weight or GPU is
touched: `prepare_server_args(argv)` (argparse, and in releases before 0.5.20 the whole ServerArgs resolution),
`resolve_once()` where the release has it, then `check_server_args()`. It prints one JSON object: the sglang
version, every option string of the parser, and per argv either `null` (accepted) or the exception with the phase it
came from and the innermost frame inside the sglang package (file:line and its source line).

GPU-only packages that SGLang imports at module level but never calls on this path are stubbed (SHIMMED): importing
them works, calling anything in them raises. Nothing in SGLang is patched.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import linecache
import os
import sys
import traceback
import types

# sgl_kernel / sglang_kernel: CUDA kernels. torchvision: PyPI's build links CUDA libraries and fails to import with a
# CPU torch (SGLang 0.5.10-0.5.20 import torchvision.io.decode_jpeg in srt/utils/common.py, only for image requests).
SHIMMED = ("sgl_kernel", "sglang_kernel", "torchvision")
SHIM_VERSION = {"torchvision": "0.28.0"}  # the release paired with torch 2.13; transformers asks for a version


class _NeverCalled:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _NeverCalled(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} belongs to a GPU-only package stubbed for argument checking")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    __path__: list = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _NeverCalled(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: set[str]):
        self.names = names
        self.imported: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__version__ = SHIM_VERSION.get(spec.name, "0.0.0")
        self.imported.add(spec.name.split(".")[0])
        return module

    def exec_module(self, module):
        pass


def install_shims() -> _StubFinder:
    finder = _StubFinder({name for name in SHIMMED if importlib.util.find_spec(name) is None})
    sys.meta_path.append(finder)  # last: a real installation always wins
    return finder


def statement_at(filename: str, lineno: int) -> str | None:
    """The whole (possibly multi-line) statement at a line: a bare `assert` says nothing without it."""
    try:
        tree = ast.parse(open(filename, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        return linecache.getline(filename, lineno).strip() or None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.lineno <= lineno <= (node.end_lineno or node.lineno):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.While,
                                     ast.With, ast.Try)):  # fmt: skip
                best = node
    if best is None:
        return linecache.getline(filename, lineno).strip() or None
    lines = linecache.getlines(filename)[best.lineno - 1 : best.end_lineno]
    return " ".join(line.strip() for line in lines)[:500]


def sglang_frame(tb) -> tuple[str | None, str | None]:
    """file:line (relative to the sglang package) and statement of the innermost traceback frame inside sglang."""
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        filename = frame.f_code.co_filename
        marker = os.sep + "sglang" + os.sep
        if marker in filename:
            found = (filename, filename.split(marker, 1)[1].replace(os.sep, "/"), lineno)
    if found is None:
        return None, None
    filename, relative, lineno = found
    return f"sglang/{relative}:{lineno}", statement_at(filename, lineno)


def check_one(prepare_server_args, argv: list[str]) -> dict | None:
    saved_env = dict(os.environ)
    phase = "parse"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            try:
                # Before 0.5.20 this also runs ServerArgs.__post_init__ (the whole resolution): only SystemExit,
                # argparse's way of failing, belongs to the parse phase.
                server_args = prepare_server_args(argv)
            except SystemExit as exit_:
                lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
                message = lines[-1].split(": error: ", 1)[-1] if lines else f"argparse exited with {exit_.code}"
                return {"phase": "parse", "type": "SystemExit", "message": message, "where": None, "source": None}
            except Exception:
                phase = "server-args"
                raise
            phase = "server-args"
            if hasattr(server_args, "resolve_once"):
                server_args.resolve_once()
            phase = "check-server-args"
            server_args.check_server_args()
        return None
    except Exception as err:  # everything SGLang raises is a verdict on the arguments
        where, source = sglang_frame(err.__traceback__)
        return {"phase": phase, "type": type(err).__name__, "message": str(err), "where": where, "source": source}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def main() -> int:
    request = json.loads(sys.stdin.read())
    finder = install_shims()
    import argparse

    import sglang
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    options = sorted(o for action in parser._actions for o in action.option_strings)
    results = [check_one(prepare_server_args, list(argv)) for argv in request["argvs"]]
    print(
        json.dumps(
            {
                "version": getattr(sglang, "__version__", None),
                "sglang_dir": os.path.dirname(sglang.__file__),
                "shimmed": sorted(finder.imported),
                "options": options,
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
