#!/usr/bin/env bash
# Build what `draftline check-sglang-args` needs to run SGLang's own argument code on CPU, and what the SGLang tests
# check against (tests/unit/test_sglang_flags.py, tests/integration/test_sglang_real_parser.py, tests/integration/test_sglang_differential.py).
#
#   ROOT/venv/              one interpreter: torch (CPU, pinned) + triton + scripts/sglang-argcheck-requirements.txt
#   ROOT/wheels/            the SGLang wheel of every release that has a flag table (engines/sglang/flags/*.json)
#   ROOT/releases/V/        `pip install --no-deps --target` of sglang==V, plus the transformers that V pins when it
#                           differs from the venv's (and whatever pip must change with it); run with PYTHONPATH=that dir
#
# SGLang is installed --no-deps: its full dependency set (flashinfer, sgl-kernel, CUDA torch) is gigabytes and only
# serves GPUs. GPU-only imports it makes at module level are shimmed by engines/sglang/sglang_probe.py, never called.
#
# Usage: scripts/setup_sglang_venv.sh [VERSION ...]   (default: the releases rules.VERSION_TABLE was checked on)
# Env:   SGLANG_ROOT (default .sglang), PYTHON (default python3), DRAFTLINE_PYTHON (default .venv/bin/python)
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
root="${SGLANG_ROOT:-$repo/.sglang}"
python_bin="${PYTHON:-python3}"
draftline_python="${DRAFTLINE_PYTHON:-$repo/.venv/bin/python}"
flags_dir="$repo/platform/draftline/engines/sglang/flags"
torch_pin="torch==2.13.0"
triton_pin="triton==3.9.0"

if [ "$#" -gt 0 ]; then
    versions=("$@")
else
    mapfile -t versions < <(PYTHONPATH="$repo/platform" "$draftline_python" -c \
        'from draftline.engines.sglang.rules import VERSION_TABLE; print("\n".join(r.checked_version for r in VERSION_TABLE))')
fi
mapfile -t releases < <(ls "$flags_dir" | sed -n 's/\.json$//p')

venv="$root/venv"
pip=("$venv/bin/pip" --quiet --disable-pip-version-check)
if [ ! -f "$venv/.installed" ] || [ "$repo/scripts/sglang-argcheck-requirements.txt" -nt "$venv/.installed" ]; then
    rm -rf "$venv"
    "$python_bin" -m venv "$venv"
    "${pip[@]}" install "$torch_pin" "$triton_pin"
    "${pip[@]}" install -r "$repo/scripts/sglang-argcheck-requirements.txt"
    touch "$venv/.installed"
fi

mkdir -p "$root/wheels" "$root/releases"
missing=()
for v in "${releases[@]}" "${versions[@]}"; do
    compgen -G "$root/wheels/sglang-$v-*.whl" >/dev/null || missing+=("$v")
done
for v in $(printf '%s\n' "${missing[@]}" | sort -u); do
    "${pip[@]}" download --no-deps --dest "$root/wheels" "sglang==$v"
done

for v in "${versions[@]}"; do
    target="$root/releases/$v"
    [ -f "$target/.installed" ] && continue
    rm -rf "$target"
    wheel=$(compgen -G "$root/wheels/sglang-$v-*.whl" | head -1)
    "${pip[@]}" install --no-deps --no-compile --target "$target" "$wheel"
    # The transformers this release pins, and what pip would have to change in the venv to have it: into the
    # target dir (it comes first on PYTHONPATH), so one venv serves releases that pin different transformers.
    pin=$(unzip -p "$wheel" "sglang-$v.dist-info/METADATA" | sed -n 's/^Requires-Dist: \(transformers==[^ ;]*\).*/\1/p')
    if [ -n "$pin" ]; then
        report="$root/releases/.report-$v.json"
        "${pip[@]}" install --dry-run --report "$report" "$pin"
        overlay=$("$venv/bin/python" -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["metadata"]["name"] + "==" + item["metadata"]["version"])' "$report")
        rm -f "$report"
        if [ -n "$overlay" ]; then
            # shellcheck disable=SC2086  # one requirement per line
            "${pip[@]}" install --no-deps --no-compile --target "$target" $overlay
        fi
    fi
    touch "$target/.installed"
    echo "sglang $v: $target${pin:+ ($pin)}"
done
