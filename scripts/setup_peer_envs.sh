#!/usr/bin/env bash
# Build the peer tools' own code, for the tests that load draftline's exports with it
# (tests/integration/test_peer_loaders.py, tests/integration/test_drafter_rope.py):
#
#   ROOT/speculators/   speculators 0.9.0 and what its model and converter code imports (pinned below)
#   ROOT/specforge/     SpecForge 0.2.0 and what its EAGLE-3 draft model code imports (pinned below)
#
# Each is a `pip install --no-deps --target` overlay run by draftline's own interpreter (.venv, torch==2.13.0 from
# the Makefile) with PYTHONPATH=ROOT/NAME: the overlay comes first on the path, so each tool gets the transformers
# (and the packages that transformers pins) that it declares, and nothing it does not import is installed. Their
# full dependency sets are GPU stacks (SpecForge pins sglang and torch 2.11; speculators torchvision/torchaudio); a
# separate venv per tool would install torch again (81 s each, measured, benchmarks/RESULTS.md "Peer tools").
#
# Usage: scripts/setup_peer_envs.sh (`make peers`)   Env: PEERS_ROOT (default .peers; tests read DRAFTLINE_PEERS_ROOT),
#        DRAFTLINE_PYTHON (default .venv/bin/python)
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
root="${PEERS_ROOT:-$repo/.peers}"
python_bin="${DRAFTLINE_PYTHON:-$repo/.venv/bin/python}"

# speculators==0.9.0 declares transformers<=5.19.0; datasets (and what pip adds for it) and hs-connectors are imported
# by speculators/models/eagle3/data.py through speculators/train/data.py, loguru by its converter.
speculators=(speculators==0.9.0 transformers==5.19.0 datasets==5.1.0 dill==0.4.1 fsspec==2026.7.0
    multiprocess==0.70.19 xxhash==4.1.0 hs-connectors==0.9.0 loguru==0.7.3)
# specforge==0.2.0 pins transformers==5.8.1, which needs an older huggingface_hub and tokenizers than .venv's;
# datasets (and what pip adds for it, speculators' pins) is imported by its data code (specforge/data/preprocessing.py,
# whose vocab mapping benchmarks/specforge_train.py uses).
specforge=(specforge==0.2.0 transformers==5.8.1 huggingface_hub==1.33.0 tokenizers==0.22.2 datasets==5.1.0 dill==0.4.1
    fsspec==2026.7.0 multiprocess==0.70.19 xxhash==4.1.0)

install() {
    local name="$1"; shift
    local target="$root/$name"
    local wanted="$*"
    if [ -f "$target/.installed" ] && [ "$(cat "$target/.installed")" = "$wanted" ]; then
        return
    fi
    rm -rf "$target"
    "$python_bin" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$target" "$@"
    echo "$wanted" > "$target/.installed"
}

install speculators "${speculators[@]}"
install specforge "${specforge[@]}"

check='from importlib.metadata import version; import transformers
print(f"{tool} {version(tool)} (transformers {transformers.__version__}) OK")'
PYTHONPATH="$root/speculators" "$python_bin" -c \
    "from speculators.convert.eagle.eagle3_converter import Eagle3Converter; tool = 'speculators'; $check"
PYTHONPATH="$root/specforge" "$python_bin" -W ignore -c \
    "from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3; tool = 'specforge'; $check"
touch "$root/.installed"
