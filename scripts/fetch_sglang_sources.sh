#!/usr/bin/env bash
# Unpack SGLang's own Python sources (no install, no dependencies) for tests that run its pure-PyTorch code paths
# (rotary embeddings) under this project's torch: .engine-sources/sglang-<version>/sglang/...
# Usage: scripts/fetch_sglang_sources.sh [DEST] [VERSION...]
set -euo pipefail

dest="${1:-.engine-sources}"
shift || true
versions=("${@:-0.5.6 0.5.12 0.5.23}")
pip_bin="${PIP:-.venv/bin/pip}"
python_bin="${PYTHON:-.venv/bin/python}"

mkdir -p "$dest/wheels"
for version in ${versions[@]}; do
  out="$dest/sglang-$version"
  [ -f "$out/.unpacked" ] && continue
  "$pip_bin" download --quiet --no-deps "sglang==$version" -d "$dest/wheels"
  rm -rf "$out"
  "$python_bin" - "$dest/wheels" "$version" "$out" <<'PY'
import glob, sys, zipfile
wheels, version, out = sys.argv[1:4]
(wheel,) = glob.glob(f"{wheels}/sglang-{version}-*.whl")
with zipfile.ZipFile(wheel) as archive:
    wanted = [n for n in archive.namelist() if n.startswith(("sglang/srt/layers/rotary_embedding", "sglang/srt/models/"))]
    archive.extractall(out, members=wanted)
PY
  touch "$out/.unpacked"
done
