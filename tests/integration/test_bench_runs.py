"""`draftline bench` for real: the reference engine vs the target alone on the test target, and the CLI's sweep."""

from __future__ import annotations

import json

import pytest

from draftline.bench.cli import run_bench
from draftline.bench.runner import format_table
from conftest import SMALL_BENCH, make_test_config

BENCH = SMALL_BENCH + ["bench.concurrency=[1,2]"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_run_reports_speedup_accept_length_and_losslessness(tiny_target_dir, fitted_drafter_dir):
    cfg = make_test_config(extra=BENCH + ["bench.rounds=2"])
    report = run_bench(cfg, [("fitted", fitted_drafter_dir, None)], log=lambda _: None)
    rows = report["rows"]
    assert [(r["label"], r["concurrency"]) for r in rows] == [
        ("target-only", 1), ("target-only", 2), ("fitted", 1), ("fitted", 2)
    ]
    for row in rows:
        assert row["requests"] == 4 and row["output_tokens"] > 0 and row["output_tokens_per_s"] > 0
        assert row["ttft_ms_p50"] > 0 and row["itl_ms_p99"] >= row["itl_ms_p50"] > 0
        assert row["lossless"] is (None if row["label"] == "target-only" else True)
    baseline, speculative = rows[0], rows[2]
    assert baseline["accept_length"] is None and baseline["speedup"] is None  # not compared with itself
    assert speculative["accept_length"] > 1.5
    low, high = speculative["speedup_ci"]
    assert low <= speculative["speedup"] <= high and high > low
    assert report["rounds"] == 2 and all(r["rounds"] == 2 for r in rows)
    assert report["machine_load"]["load_avg_1m_max"] >= report["machine_load"]["load_avg_1m_min"] >= 0
    assert "fitted" in format_table(rows)



def test_bench_cli_sweep_stores_best_config_on_the_version(tmp_path, tiny_target_dir, fitted_drafter_dir, capsys):
    import mlflow

    from draftline.cli import main
    from draftline.drafter.export import load_drafter
    from draftline.tracking import BENCH_BEST_TAG, mlflow_client
    from registry_helpers import mlflow_test_config, register_drafter

    cfg = mlflow_test_config(tmp_path, BENCH)
    version = register_drafter(cfg, load_drafter(fitted_drafter_dir))
    out = tmp_path / "bench.json"
    overrides = [
        f"{k}={v}" for k, v in {
            "tracking.tracking_uri": cfg.tracking.tracking_uri,
            "tracking.artifact_location": cfg.tracking.artifact_location,
            "bench.sweep_grid": "[[2,1,3],[2,2,4]]",
            "bench.concurrency": "[1]",
        }.items()
    ]  # fmt: skip
    from conftest import TEST_OVERRIDES

    code = main(["bench", "--version", version, "--sweep", "--num-prompts", "3", "--out", str(out), "--config",
                 "configs/tiny-cpu.yaml", *TEST_OVERRIDES, f"data_dir={cfg.data_dir}", *overrides])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert {row["spec"] for row in report["rows"]} == {"-", "2/1/3", "2/2/4"}
    tags = mlflow_client(cfg).get_model_version(cfg.registered_model_name, version).tags
    assert json.loads(tags[BENCH_BEST_TAG]) == report["best"] and set(report["best"]) == {"1"}
    run = mlflow.get_run(tags["bench_run_id"])
    assert run.data.tags["model_version"] == version
    assert "tok/s" in capsys.readouterr().out
