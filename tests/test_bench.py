"""`draftline bench`: prompt sources, metrics, and a real (small) run of the reference engine vs the target alone."""

from __future__ import annotations

import json

import pytest

from draftline.bench.cli import best_per_concurrency, run_bench
from draftline.bench.prompts import load_prompt_file, prompt_from_sample
from draftline.bench.runner import format_table, percentile
from conftest import SMALL_BENCH, make_test_config

BENCH = SMALL_BENCH + ["bench.concurrency=[1,2]"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_prompt_file_formats(tmp_path, tiny_target_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"id": "ids", "input_ids": [5, 6, 7]},
        {"id": "msgs", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "drop me"}]},
        {"question_id": 81, "turns": ["hi", "second turn"]},
        {"prompt": "hi"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    prompts = load_prompt_file(path, tokenizer)
    assert [p.id for p in prompts] == ["ids", "msgs", "81", "4"]
    assert prompts[0].input_ids == [5, 6, 7]
    assert prompts[1].input_ids == prompts[2].input_ids == prompts[3].input_ids  # one user turn "hi", reply dropped
    assert "drop me" not in tokenizer.decode(prompts[1].input_ids)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl line 1: .*input_ids, messages, turns or prompt"):
        load_prompt_file(bad, tokenizer)


def test_prompt_from_sample_stops_at_the_reply():
    assert prompt_from_sample({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}) == [1, 2]


def test_best_per_concurrency_skips_lossy_and_baseline_rows():
    rows = [
        {"label": "target-only", "spec": "-", "concurrency": 1, "output_tokens_per_s": 999.0, "lossless": True},
        {"label": "v1", "spec": "3/1/4", "concurrency": 1, "output_tokens_per_s": 120.0, "lossless": True,
         "speedup": 1.2, "accept_length": 3.0},
        {"label": "v1", "spec": "5/1/6", "concurrency": 1, "output_tokens_per_s": 150.0, "lossless": False,
         "speedup": 1.5, "accept_length": 4.0},
        {"label": "v1", "spec": "3/2/6", "concurrency": 1, "output_tokens_per_s": 130.0, "lossless": True,
         "speedup": 1.3, "accept_length": 2.5},
    ]  # fmt: skip
    best = best_per_concurrency(rows)
    assert best == {"1": {"num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 6, "output_tokens_per_s": 130.0,
                          "speedup": 1.3, "accept_length": 2.5}}  # fmt: skip


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
    fitted = f"fitted {speculative['spec']}"
    assert report["engines_up_together"] and report["round_order"] == [["target-only", fitted], [fitted, "target-only"]]
    assert all(r["cpu_of"] == "this process" and r["cpu_ms_per_token"] > 0 for r in rows)
    assert report["machine_load"]["load_avg_1m_max"] >= report["machine_load"]["load_avg_1m_min"] >= 0
    assert "fitted" in format_table(rows)


@pytest.mark.slow
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
