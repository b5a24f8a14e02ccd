"""Shape twins (configs/twins/): each family's real transformers class and config semantics at CPU size, trained
here so its replies are learnable, served token-identically by the reference engine (MoE and MLA caches included).
One twin per architecture class also runs the whole pipeline: tests/e2e/test_twin_pipelines.py.

Twins are built once per test data dir (cached by hash, like the embedded default). Every production config and its
twin must pass `draftline run --dry-run`.
"""

from __future__ import annotations


import pytest
import torch

from conftest import PRODUCTION, REPO, TWINS, twin_config
from draftline.config import load_config
from draftline.engines import make_engine
from draftline.engines.base import SamplingParams
from draftline.target.bootstrap import bootstrap_summary, bootstrap_target
from draftline.target.load import default_aux_layer_ids, read_target_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.fixture(scope="module", params=TWINS)
def twin(request):
    cfg = twin_config(request.param)
    return request.param, cfg, bootstrap_target(cfg)






def test_twin_has_its_family_semantics_and_learned_the_corpus(twin):
    name, cfg, target_dir = twin
    want = PRODUCTION[name]
    hf = read_target_config(target_dir)
    assert hf["architectures"] == [want["architecture"]]
    assert (hf.get("rope_parameters") or {}).get("rope_type", "default") == want["rope_type"]
    assert hf["num_attention_heads"] // hf["num_key_value_heads"] == want["gqa"]
    assert hf["tie_word_embeddings"] is False
    # Both CPU engines (vLLM CPU attention, SGLang intel_amx) need head widths that are multiples of 32.
    head_widths = [hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["v_head_dim"]] if "kv_lora_rank" in hf else [hf["head_dim"]]
    assert all(w % 32 == 0 for w in head_widths), head_widths
    if name == "kimi-k2.5":
        assert hf["first_k_dense_replace"] == 1 and hf["n_shared_experts"] == 1 and hf["kv_lora_rank"] > 0
    summary = bootstrap_summary(target_dir)
    assert summary["heldout_perplexity"] < summary["uniform_perplexity"] / 20
    assert summary["heldout_perplexity"] < summary["unigram_perplexity"] / 2
    assert bootstrap_target(cfg) == target_dir  # cached by hash


def test_dense_first_and_moe_layers_are_what_the_config_says(twin):
    name, cfg, target_dir = twin
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir)
    mlp_kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    if name == "kimi-k2.5":
        assert mlp_kinds[0] == "DeepseekV3MLP" and set(mlp_kinds[1:]) == {"DeepseekV3MoE"}
    elif name == "qwen3-30b-a3b":
        assert set(mlp_kinds) == {"Qwen3MoeSparseMoeBlock"}
    else:
        assert "MoE" not in "".join(mlp_kinds)


def _prompts(cfg, target_dir, count: int) -> list[list[int]]:
    from draftline.data.prepare import load_split, prepare

    samples = load_split(prepare(cfg, target_dir), "bench")
    return [s["input_ids"][: s["loss_mask"].index(1)] for s in samples if 1 in s["loss_mask"]][:count]


def test_reference_engine_is_token_identical_to_the_target(twin, tmp_path):
    """Greedy: target-only engine == HF generate; EAGLE-3 chain and tree == target-only, through the family's caches."""
    from draftline.drafter.export import export_drafter
    from registry_helpers import random_drafter

    name, cfg, target_dir = twin
    prompts = _prompts(cfg, target_dir, 4)
    target_only = make_engine(cfg, target_dir)
    target_only.load()
    params = SamplingParams(max_new_tokens=20)
    expected = {}
    for ids in prompts:
        ours, _ = target_only.generate_ids(ids, params)
        hf = target_only.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                        attention_mask=torch.ones(1, len(ids)))  # fmt: skip
        assert ours == hf[0, len(ids) :].tolist()[: len(ours)], name
        expected[tuple(ids)] = ours
    drafter_dir = export_drafter(random_drafter(target_dir, cfg.data.draft_vocab_size, seed=1), tmp_path / "drafter")
    for spec in ([], ["engine.speculative.eagle_topk=2", "engine.speculative.num_draft_tokens=6"]):
        engine = make_engine(twin_config(name, spec), target_dir, drafter_dir, model_version="random")
        engine.load()
        for ids in prompts:
            assert engine.generate_ids(ids, params)[0] == expected[tuple(ids)], (name, spec)


def test_aux_layer_rule_is_the_productions(twin):
    name, cfg, target_dir = twin
    num_layers = read_target_config(target_dir)["num_hidden_layers"]
    assert cfg.extract.aux_layer_ids is None  # the family's default rule, as in production
    production_path = REPO / "configs" / f"{name}.yaml"
    if production_path.exists():
        production = load_config(production_path)
        assert production.extract.aux_layer_ids == default_aux_layer_ids(production.target.num_layers)
        ratio = production.data.draft_vocab_size / production.target.vocab_size
        twin_ratio = cfg.data.draft_vocab_size / cfg.target.embedded.vocab_size
        assert abs(twin_ratio - ratio) < 0.01, (twin_ratio, ratio)
        assert production.engine.speculative == cfg.engine.speculative
    assert len(default_aux_layer_ids(num_layers)) == len(set(default_aux_layer_ids(num_layers)))
