#!/usr/bin/env bash
# GPU smoke test: draftline's own CUDA paths, then the SGLang engine with a real server.
#   scripts/gpu_smoke.sh [DRAFTER_EXPORT_DIR]
# 1. scripts/gpu_check.py: the reference engine (chain and tree drafts), the training objective and the export on CUDA,
#    each against CPU on the same machine (needs torch with CUDA, transformers, pydantic, pyyaml, numpy only: no Ray,
#    DeepSpeed, MLflow or SGLang), on the test target and fitted drafter in $DRAFTLINE_TEST_DATA_DIR (built when absent);
# 1b. one TTT training step per attention path at the Llama-3.1-8B drafter shape, L=2048 (benchmarks/train_memory.py:
#    materialised, fused, fused-packed, fused-padded, blocked; step time and peak memory into train_memory_gpu.json),
#    capped at $GPU_SMOKE_TRAIN_SPEED_LIMIT_S (default 280 s; 0 skips it); the parts below keep their own budget;
# 2. makes sure an interpreter with a full SGLang (pinned) exists: $SGLANG_PYTHON, else .venv-sglang-gpu
#    (created with `pip install sglang[all]==$SGLANG_VERSION` when missing: needs the network);
# 3. bootstraps the tiny target (cached) and uses DRAFTER_EXPORT_DIR, or fits a quick drafter in-process;
# 4. launches `python -m sglang.launch_server` through SGLangEngine (preflighted command, /health wait),
#    sends a few requests, checks spec stats, then runs the bench (target-only vs EAGLE-3 on the same server type).
# Last line: PASS, FAIL (with the reason), or INCOMPLETE (exit 2: part 1 passed, SGLang could not be installed or
# run there, and why). Part 1b is capped at its own limit; the rest at 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
if [ -z "${DRAFTLINE_PYTHON:-}" ]; then
    DRAFTLINE_PYTHON=.venv/bin/python
    [ -x "$DRAFTLINE_PYTHON" ] || DRAFTLINE_PYTHON=python3  # a GPU image's own torch (part 1 needs no more)
fi
SGLANG_PYTHON="${SGLANG_PYTHON:-.venv-sglang-gpu/bin/python}"
DRAFTER_DIR="${1:-}"
TIME_LIMIT_S="${GPU_SMOKE_TIME_LIMIT_S:-470}"
started_s=$(date +%s)
export PYTHONPATH="platform:tests${PYTHONPATH:+:$PYTHONPATH}"

fail() { echo "FAIL: $*"; exit 1; }
incomplete() { echo "INCOMPLETE: draftline's CUDA paths passed (gpu_check.json); SGLang serving not run: $*"; exit 2; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader \
    || fail "no nvidia-smi: this smoke test needs a GPU machine"
"$DRAFTLINE_PYTHON" scripts/gpu_check.py "${DRAFTLINE_TEST_DATA_DIR:-.draftline-test}" gpu_check.json \
    || fail "draftline's own CUDA paths (scripts/gpu_check.py, figures in gpu_check.json)"

TRAIN_SPEED_LIMIT_S="${GPU_SMOKE_TRAIN_SPEED_LIMIT_S:-280}"
if [ "$TRAIN_SPEED_LIMIT_S" -gt 0 ]; then
    # materialised first: the ratios are to it; blocked (the slowest) last, so a time limit cuts it first.
    timeout "$TRAIN_SPEED_LIMIT_S" "$DRAFTLINE_PYTHON" benchmarks/train_memory.py --device cuda --shape llama8b \
        --runs materialised:2048 fused:2048 fused-packed:2048 fused-padded:2048 blocked:2048 \
        --out train_memory_gpu.json \
        || echo "[gpu-smoke] train step run stopped (exit $?) after ${TRAIN_SPEED_LIMIT_S}s or earlier: runs so far in train_memory_gpu.json"
    started_s=$(date +%s)  # the serving part below keeps its whole budget
fi

if ! "$SGLANG_PYTHON" -c "import sglang, sglang.srt.entrypoints.http_server" 2>/dev/null; then
    echo "[gpu-smoke] installing sglang[all]==$SGLANG_VERSION into .venv-sglang-gpu"
    python3 -m venv .venv-sglang-gpu || incomplete "cannot create .venv-sglang-gpu"
    timeout 300 .venv-sglang-gpu/bin/pip install --quiet --retries 0 --timeout 10 "sglang[all]==$SGLANG_VERSION" \
        || incomplete "pip install sglang[all]==$SGLANG_VERSION failed (no network? set SGLANG_PYTHON to an install)"
    SGLANG_PYTHON=.venv-sglang-gpu/bin/python
fi
installed=$("$SGLANG_PYTHON" -c "import sglang; print(sglang.__version__)") || incomplete "sglang does not import"
[ "$installed" = "$SGLANG_VERSION" ] || echo "[gpu-smoke] warning: sglang $installed installed, $SGLANG_VERSION pinned"

left_s=$(( TIME_LIMIT_S - ($(date +%s) - started_s) ))
[ "$left_s" -gt 60 ] || fail "install used the time budget"

timeout "$left_s" "$DRAFTLINE_PYTHON" - "$SGLANG_PYTHON" "$installed" "$DRAFTER_DIR" <<'PY'
import asyncio
import json
import sys
import time
from pathlib import Path

from draftline.bench.run import run_bench
from draftline.bench.runner import format_table
from draftline.config import load_config
from draftline.engines import make_engine
from draftline.engines.base import SamplingParams

sglang_python, sglang_version, drafter_arg = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = load_config(
    "configs/tiny-cpu.yaml",
    [
        "engine.backend=sglang",
        "engine.device=cuda",
        f"engine.sglang.python={sglang_python}",
        f"engine.sglang.version={sglang_version}",
        "engine.sglang.port=30123",
        "engine.sglang.mem_fraction_static=0.3",
        "engine.sglang.attention_backend=triton",  # the tiny target's head_dim (48) is not a FlashInfer size
        "engine.sglang.startup_timeout_s=240",
        "engine.sglang.extra_args=['--disable-cuda-graph']",  # startup time matters more than speed here
        "bench.num_prompts=8",
        "bench.concurrency=[1,4]",
        "bench.max_new_tokens=32",
    ],
)
from draftline.data.prepare import prepare
from draftline.target.load import resolve_target_dir

target_dir = resolve_target_dir(cfg)
if drafter_arg:
    drafter_dir = Path(drafter_arg)
else:
    from draftline.bench.quick_drafter import quick_drafter

    drafter_dir = quick_drafter(cfg, target_dir, prepare(cfg, target_dir), steps=300)
print(f"[gpu-smoke] target {target_dir}, drafter {drafter_dir}", flush=True)


async def requests() -> list:
    engine = make_engine(cfg, target_dir, drafter_dir, model_version="smoke")
    started = time.perf_counter()
    await engine.start()
    print(f"[gpu-smoke] server healthy after {time.perf_counter() - started:.0f} s", flush=True)
    try:
        results = []
        for prompt in ([1, 4, 300, 301, 302], [1, 4, 500, 20, 21, 5]):
            chunks = [c async for c in engine.generate(prompt, SamplingParams(max_new_tokens=24))]
            results.append(chunks)
        return results
    finally:
        await engine.stop()


problems = []
for chunks in asyncio.run(requests()):
    tokens = [t for c in chunks for t in c.token_ids]
    final = chunks[-1]
    print(f"[gpu-smoke] {len(tokens)} tokens, finish {final.finish_reason}, stats {final.stats}", flush=True)
    if not tokens or not final.finished:
        problems.append("a request returned no tokens or never finished")
    elif final.stats is None or final.stats.verify_steps == 0:
        problems.append("no spec_verify_ct in meta_info: speculative decoding did not run")
report = run_bench(cfg, [("eagle3", drafter_dir, None)])
print(format_table(report["rows"]))
Path("gpu_smoke_bench.json").write_text(json.dumps(report, indent=2) + "\n")
eagle = [r for r in report["rows"] if r["label"] == "eagle3"]
if not eagle or any((r["accept_length"] or 0) <= 1.0 for r in eagle):
    problems.append(f"accept length not above 1: {[r['accept_length'] for r in eagle]}")
if problems:
    print("FAIL: " + "; ".join(problems))
    sys.exit(1)
print("PASS: SGLang served the tiny target with the EAGLE-3 drafter; bench in gpu_smoke_bench.json")
PY
status=$?
[ $status -eq 124 ] && fail "time limit ${TIME_LIMIT_S}s reached"
exit $status
