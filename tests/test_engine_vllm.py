"""vLLM's CPU build (.venv-vllm, `make setup-vllm`) serving the test target and a registered drafter version, for real.

The conftest's fitted drafter is registered in a test-local MLflow store the way the train stage registers its export
(`tracking.register_export`), and everything goes through `draftline bench --engine vllm --version N` (the CLI, in
this process), so vLLM serves the version's files as the registry hands them out; greedy on the bench prompts, one
round at concurrency 1: the bench starts one vLLM server per role (target alone, then target + the version's EAGLE-3
export) and checks losslessness against the target alone; its accept length comes from vLLM's own counters (output
tokens / drafts). `draftline bench --version N` with the reference engine runs the same prompts with the same version.
The 3% check catches the aux-id off-by-one (the SGLang ids as vLLM's top-level key moved vLLM's accept length by -5.4%
on these prompts: benchmarks/RESULTS.md). Two vLLM start-ups, so marked slow.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import TEST_CONFIG, VLLM_TEST_OVERRIDES, config_overrides, make_test_config
from registry_helpers import mlflow_overrides, register_export_dir

pytestmark = pytest.mark.slow

# The config's bench prompts (at test size the bench split has 19, each answered in about 8 tokens), greedy (the
# bench's default temperature, which checks losslessness), one round at concurrency 1: a second or two per load, so
# the two server start-ups are the cost. Fewer prompts would not do: 8 of them make about 23 drafts, where one draft
# more or less moves the accept length by 4%, more than the 3% being checked.
BENCH_ARGS = ["--concurrency", "1"]
BENCH_OVERRIDES = ["bench.rounds=1"]
MIN_DRAFTS = 40  # one draft is then at most 2.5% of the accept length
# vLLM 0.32 (vllm/v1/worker/gpu_model_runner.py, any target family) logs the ids it read from the draft's config.
AUX_IDS_LOGGED = re.compile(r"Using auxiliary layers from speculative config: \(([\d, ]*)\)")
MAX_ACCEPT_LENGTH_GAP = 0.03


class VLLMLogLines(logging.Handler):
    """The vLLM servers' output lines (ServerProcess forwards each one to the `draftline.vllm` logger)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@dataclass(frozen=True)
class RegisteredVersion:
    overrides: list[str]  # the test-local MLflow store
    version: str
    export_dir: Path  # the version's files as the registry resolves them (its MLflow artifacts)


@pytest.fixture(scope="module")
def registered(tmp_path_factory, tiny_target_dir, fitted_drafter_dir) -> RegisteredVersion:
    from draftline.registry import get_version

    overrides = mlflow_overrides(tmp_path_factory.mktemp("mlflow"))
    cfg = make_test_config(extra=overrides)
    version = register_export_dir(cfg, fitted_drafter_dir)
    export_dir = get_version(cfg, version).export_dir
    assert export_dir.resolve() != fitted_drafter_dir.resolve(), "the version must be served from its MLflow artifacts"
    return RegisteredVersion(overrides, version, export_dir)


def bench_through_cli(tmp_path, name: str, registered: RegisteredVersion, extra_args: list[str],
                      overrides: list[str]) -> dict:  # fmt: skip
    from draftline.cli import main

    out = tmp_path / f"{name}.json"
    argv = ["bench", *extra_args, "--version", registered.version, *BENCH_ARGS, "--out", str(out),
            "--config", str(TEST_CONFIG), *config_overrides(extra=BENCH_OVERRIDES + registered.overrides + overrides)]
    started = time.perf_counter()
    assert main(argv) == 0, f"draftline {' '.join(argv)} failed"
    print(f"[test_engine_vllm] {name} bench: {time.perf_counter() - started:.1f} s")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def vllm_bench(tmp_path_factory, registered):
    """(report, vLLM log lines) of `draftline bench --engine vllm` (the engine flag, not the config, picks vLLM)."""
    vllm_overrides = [o for o in VLLM_TEST_OVERRIDES if not o.startswith("engine.backend=")]
    logger = logging.getLogger("draftline.vllm")
    handler, level = VLLMLogLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        out_dir = tmp_path_factory.mktemp("vllm")
        report = bench_through_cli(out_dir, "vllm", registered, ["--engine", "vllm"], vllm_overrides)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return report, handler.lines


@pytest.fixture(scope="module")
def reference_bench(tmp_path_factory, registered):
    return bench_through_cli(tmp_path_factory.mktemp("reference"), "reference", registered, [], [])


def drafter_row(report: dict, registered: RegisteredVersion) -> dict:
    (row,) = [row for row in report["rows"] if row["label"] == f"v{registered.version}"]
    return row


def test_vllm_with_the_drafter_is_token_identical_to_vllm_alone(vllm_bench, registered):
    report, _ = vllm_bench
    assert report["backend"] == "vllm" and report["temperature"] == 0
    row = drafter_row(report, registered)
    counters = row["engine_counters"]
    # The drafter really ran: vLLM counted drafts and accepted some of them.
    assert row["output_tokens"] > 0 and counters["drafts"] > 0 and counters["accepted_tokens"] > 0, row
    assert row["lossless"] is True, f"vLLM with the drafter differs from vLLM serving the target alone: {row}"


def test_vllm_reads_the_exports_top_level_aux_ids(vllm_bench, registered):
    _, lines = vllm_bench
    written = json.loads((registered.export_dir / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    logged = [tuple(int(i) for i in m.group(1).split(",") if i.strip()) for m in map(AUX_IDS_LOGGED.search, lines) if m]
    # Only the speculative server loads a draft: one line, with exactly the ids written for vLLM.
    assert logged == [tuple(written)], f"vLLM logged aux ids {logged}, the export wrote {written} for vLLM"


def test_vllm_accept_length_is_within_3_percent_of_the_reference_engines(vllm_bench, reference_bench, registered):
    report, _ = vllm_bench
    vllm_row, reference_row = drafter_row(report, registered), drafter_row(reference_bench, registered)
    assert reference_bench["backend"] == "reference" and reference_row["lossless"] is True
    assert vllm_row["engine_counters"]["drafts"] >= MIN_DRAFTS, f"too few drafts to resolve 3%: {vllm_row}"
    vllm_accept, reference_accept = vllm_row["accept_length"], reference_row["accept_length"]
    gap = abs(vllm_accept - reference_accept) / reference_accept
    assert gap <= MAX_ACCEPT_LENGTH_GAP, (
        f"accept length: vLLM {vllm_accept} ({vllm_row['engine_counters']}), reference {reference_accept}: "
        f"{gap:.1%} apart on the same prompts and drafter (aux ids, RoPE or d2t read differently?)"
    )
