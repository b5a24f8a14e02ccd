#!/usr/bin/env bash
# Create .venv-sglang: a separate interpreter with SGLang installed, used only to cross-check the
# launch commands draftline generates against SGLang's own argument parser (tests/test_sglang_real_parser.py).
# Only what `sglang.srt.server_args` needs to build its argparse parser is installed: importing sglang pulls in
# torch (sglang/__init__ -> srt/utils/common.py imports torch), so torch is installed too, pinned exactly and
# CPU-only where a local +cpu wheel is available; nothing here runs a model.
# Usage: scripts/setup_sglang_venv.sh [VENV_DIR] [SGLANG_VERSION]
set -euo pipefail

venv_dir="${1:-.venv-sglang}"
sglang_version="${2:-0.5.23}"
python_bin="${PYTHON:-python3}"

"$python_bin" -m venv "$venv_dir"
# --no-deps: sglang's full dependency set (torch, flashinfer, ...) is gigabytes and unneeded for arg parsing.
"$venv_dir/bin/pip" install --quiet --no-deps "sglang==${sglang_version}"
"$venv_dir/bin/pip" install --quiet numpy orjson psutil pybase64 requests triton packaging pillow \
    starlette msgspec pydantic pyzmq tqdm IPython aiohttp
"$venv_dir/bin/pip" install --quiet "torch==2.13.0"

"$venv_dir/bin/python" - <<'PY'
import argparse

from sglang.srt.server_args import ServerArgs

parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
print(f"sglang argument parser OK: {len(parser._actions)} actions")
PY
