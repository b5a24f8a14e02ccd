"""`draftline bench` for real: the reference engine vs the target alone on the test target, and the CLI's sweep."""

from __future__ import annotations

import json

import pytest

from draftline.bench.run import run_bench
from draftline.bench.runner import format_table
from conftest import SMALL_BENCH, make_test_config

BENCH = SMALL_BENCH + ["bench.concurrency=[1,2]"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_benchmark_prompts_one_per_user_turn_after_the_targets_own_answer(tmp_path, tiny_target_dir):
    """Any jsonl of prompts or conversations through the one loader; turn 2 is asked after the target's own greedy
    answer to turn 1 (the reference engine's, as HF generate gives it), a reply written in the file is never used."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftline.bench.prompts import load_bench_prompts, render

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    path = tmp_path / "prompts.jsonl"
    first, second = "What does `def join(a, *p)` in posixpath do?", "What does `def split(p)` in posixpath do?"
    lines = [
        {"id": "msgs", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "drop me"}]},
        {"question_id": 81, "turns": [first, second]},
        {"prompt": "hi"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    cfg = make_test_config(tmp_path / "data", [f"bench.prompts={path}", "bench.max_new_tokens=12"])
    prompts = load_bench_prompts(cfg, tokenizer, None, tiny_target_dir)
    assert [p.id for p in prompts] == ["msgs", "81", "81/turn2", "prompts.jsonl:3"]
    hi = render(tokenizer, [{"role": "user", "content": "hi"}])
    assert prompts[0].input_ids == prompts[3].input_ids == hi
    assert prompts[1].input_ids == render(tokenizer, [{"role": "user", "content": first}])
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    with torch.no_grad():
        ids = torch.tensor([prompts[1].input_ids])
        greedy = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
    answer = tokenizer.decode(greedy, skip_special_tokens=True).strip()
    assert prompts[2].input_ids == render(tokenizer, [{"role": "user", "content": first},
                                                      {"role": "assistant", "content": answer},
                                                      {"role": "user", "content": second}])
    assert [p.input_ids for p in load_bench_prompts(cfg, tokenizer, None, tiny_target_dir)] == [p.input_ids for p in prompts]
    assert len(list(cfg.data_path("benchmarks").glob("prompts-answers-*.jsonl"))) == 1  # answered once, then cached
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    bad_cfg = make_test_config(tmp_path / "data", [f"bench.prompts={bad}"])
    with pytest.raises(ValueError, match="bad.jsonl.*1 unusable record.*bad.jsonl:1: bad_field"):
        load_bench_prompts(bad_cfg, tokenizer, None, tiny_target_dir)


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


def test_bench_splits_accept_length_by_segment(tmp_path, tiny_target_dir, fitted_drafter_dir):
    """Prompts with tools and plain ones in one bench: each segment's accept length over its own requests, the row's
    (over all requests) between them, in the JSON and in the printed table. The test target's template renders no
    tools, so the segments differ only in their prompts' text here."""
    path = tmp_path / "prompts.jsonl"
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    lines = [{"id": "tool-1", "tools": tools, "prompt": "What does `def join(a, *p)` in posixpath do?"},
             {"id": "plain-1", "prompt": "What does `def split(p)` in posixpath do?"},
             {"id": "plain-2", "prompt": "What does `def basename(p)` in posixpath do?"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = make_test_config(extra=SMALL_BENCH + [f"bench.prompts={path}", "bench.concurrency=[1]", "bench.rounds=1"])
    report = run_bench(cfg, [("fitted", fitted_drafter_dir, None)], log=lambda _: None)
    baseline, speculative = report["rows"]
    assert baseline["accept_length_by_segment"] == {"has-tools": {"accept_length": None, "prompts": 1},
                                                    "plain": {"accept_length": None, "prompts": 2}}
    segments = speculative["accept_length_by_segment"]
    assert {name: v["prompts"] for name, v in segments.items()} == {"has-tools": 1, "plain": 2}
    values = [v["accept_length"] for v in segments.values()]
    assert min(values) > 1 and min(values) <= speculative["accept_length"] <= max(values)
    assert f"accept by segment, fitted {speculative['spec']} c1: has-tools {segments['has-tools']['accept_length']} (1 prompts)" in format_table(report["rows"])


def test_bench_run_on_another_datasets_bench_split(tmp_path, tiny_target_dir, tiny_dataset_dir, fitted_drafter_dir):
    """`dataset_dir` benches on that prepared dataset's bench split (here a copy holding one of its samples), not on
    the one the config would prepare; every prompt of it is in the `plain` segment (no tools, no data.thinking)."""
    import shutil

    copy = tmp_path / "dataset"
    shutil.copytree(tiny_dataset_dir, copy)
    bench = copy / "bench.jsonl"
    bench.write_text(bench.read_text().splitlines()[0] + "\n")
    cfg = make_test_config(extra=SMALL_BENCH + ["bench.rounds=1", "bench.concurrency=[1]"])
    report = run_bench(cfg, [("fitted", fitted_drafter_dir, None)], log=lambda _: None, dataset_dir=copy)
    fitted = [r for r in report["rows"] if r["label"] == "fitted"]
    assert [r["requests"] for r in report["rows"]] == [1, 1]
    assert list(fitted[0]["accept_length_by_segment"]) == ["plain"]
    assert fitted[0]["accept_length_by_segment"]["plain"]["prompts"] == 1
