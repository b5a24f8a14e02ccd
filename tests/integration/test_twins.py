"""Shape twins (configs/twins/): each family's real transformers class and config semantics at CPU size, trained
here so its replies are learnable, served token-identically by the reference engine (MoE and MLA caches included).
One twin per architecture class also runs the whole pipeline: tests/e2e/test_twin_pipelines.py.

Twins are built once per test data dir (cached by hash, like the embedded default). Every production config and its
twin must pass `draftline run --dry-run`.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import PRODUCTION, REPO, TWINS, bench_prompts, prompt_past_window, twin_config
from draftline.config import load_config
from draftline.engines import make_engine
from draftline.engines.base import SamplingParams
from draftline.engines.reference.sequence import new_sequence
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
    assert hf["tie_word_embeddings"] is want.get("tied", False)
    # Both CPU engines (vLLM CPU attention, SGLang intel_amx) need head widths that are multiples of 32.
    head_widths = [hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["v_head_dim"]] if "kv_lora_rank" in hf else [hf["head_dim"]]
    assert all(w % 32 == 0 for w in head_widths), head_widths
    if name == "kimi-k2.5":
        assert hf["first_k_dense_replace"] == 1 and hf["n_shared_experts"] == 1 and hf["kv_lora_rank"] > 0
    if name == "gemma3-1b":  # 5 local layers to 1 global, head_dim 256 (4 heads x 256 on a 128-wide stream)
        assert hf["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
        assert hf["head_dim"] == 256 and hf["query_pre_attn_scalar"] == 256 and hf["sliding_window"] == 32
        assert hf["vocab_size"] >= 4 * 2048 and cfg.data.draft_vocab_size < hf["vocab_size"] / 8
    if name == "gpt-oss-20b":  # even layers slide (vLLM's gpt_oss.py hard-codes that parity), sinks, 2 of 16 experts
        assert hf["layer_types"] == ["sliding_attention", "full_attention"] * 4 and hf["sliding_window"] == 32
        assert (hf["num_local_experts"], hf["num_experts_per_tok"], hf["attention_bias"]) == (16, 2, True)
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
    elif name == "gpt-oss-20b":  # router + experts in every layer, and a learned sink logit per head
        assert set(mlp_kinds) == {"GptOssMLP"} and model.model.layers[0].mlp.router.weight.shape[0] == 16
        assert all(layer.self_attn.sinks.shape == (8,) for layer in model.model.layers)
    else:
        assert "MoE" not in "".join(mlp_kinds)


def test_reference_engine_is_token_identical_to_the_target(twin, tmp_path):
    """Greedy: target-only engine == HF generate; EAGLE-3 chain and tree == target-only, through the family's caches."""
    from draftline.drafter.export import export_drafter
    from registry_helpers import random_drafter

    name, cfg, target_dir = twin
    prompts = bench_prompts(cfg, target_dir, 4)
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


def test_the_drafter_embeds_tokens_with_the_stored_table_as_training_does(twin):
    """The reference engine's drafter input is the embedding tensor training reads (train/data.py), not the target's
    embedding module output: Gemma scales that by sqrt(hidden), which the engines do not hand the drafter."""
    from draftline.target.capture import drafter_token_embedding
    from draftline.train.data import load_target_head

    _, cfg, target_dir = twin
    engine = make_engine(cfg, target_dir)
    engine.load()
    ids = torch.arange(0, engine.model.config.vocab_size, 97)[None]
    assert torch.equal(drafter_token_embedding(engine.model)(ids), load_target_head(target_dir).embed(ids))


# Twins whose layers attend within a sliding window: prompts outgrow it, and the reference engine's window cache
# must give what HF generate gives.
WINDOWED = ["gemma3-1b", "gpt-oss-20b"]


@pytest.fixture(scope="module", params=WINDOWED)
def windowed_twin(request):
    cfg = twin_config(request.param)
    return request.param, cfg, bootstrap_target(cfg)


def test_reference_engine_keeps_each_layers_window(windowed_twin, tmp_path):
    """A prompt three windows long: target-only and EAGLE-3 chain and tree == HF generate (whose sliding layers see
    the last `sliding_window` tokens), while HF with the window widened to the context gives other logits for the
    prompt (so the window is what is being checked: the greedy tokens themselves may agree, a trained twin's often
    do); after a step the sliding layers' cache holds the window-1 tokens the next query sees besides itself, the
    full layers' every token."""
    from draftline.drafter.export import export_drafter
    from registry_helpers import random_drafter

    name, cfg, target_dir = windowed_twin
    engine = make_engine(cfg, target_dir)
    engine.load()
    model = engine.model
    window = model.config.sliding_window
    ids = prompt_past_window(cfg, target_dir, window)
    params = SamplingParams(max_new_tokens=24)
    ours, _ = engine.generate_ids(ids, params)

    def hf_generate():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, attention_mask=torch.ones(1, len(ids)))
        return out[0, len(ids) :].tolist()[: len(ours)]

    def last_logits():
        with torch.no_grad():
            return model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0, -1]

    assert ours == hf_generate(), name
    windowed = last_logits()
    model.config.sliding_window = model.config.max_position_embeddings
    try:
        widened = last_logits()
    finally:
        model.config.sliding_window = window
    assert torch.equal(windowed, last_logits()), name  # the window is restored
    gap = (windowed - widened).abs().max().item()
    assert gap > 1e-3, f"{name}: the prompt does not reach past the window (logits differ by at most {gap})"
    drafter_dir = export_drafter(random_drafter(target_dir, cfg.data.draft_vocab_size, seed=1), tmp_path / "drafter")
    for spec in ([], ["engine.speculative.eagle_topk=2", "engine.speculative.num_draft_tokens=6"]):
        speculative = make_engine(twin_config(name, spec), target_dir, drafter_dir, model_version="random")
        speculative.load()
        assert speculative.generate_ids(ids, params)[0] == ours, (name, spec)
        sequence = new_sequence(ids, params, speculative.stop_token_ids, speculative.device)
        caches = speculative._prefill([sequence])
        speculative._step_batch([sequence], caches)
        sliding, full = caches.target.groups["sliding_attention"], caches.target.groups["full_attention"]
        cached = len(sequence.tokens) - 1  # the last committed token is the next verify's root
        assert sliding.window == window and sliding.valid.shape[1] == window - 1 < cached == full.valid.shape[1]
        assert caches.target.cache.layers[sliding.layer_ids[0]].keys.shape[2] == window - 1


def test_windowed_requests_batch_token_identically(windowed_twin, tmp_path):
    """Ragged requests, some three windows long, at concurrency 3 with an EAGLE-3 chain: rows join, step together and
    leave at different lengths, each sliding group compacting its rows' windows apart; every reply is the target
    alone's for that request, and the steps really were batched."""
    from draftline.drafter.export import export_drafter
    from registry_helpers import random_drafter

    name, cfg, target_dir = windowed_twin
    target_only = make_engine(cfg, target_dir)
    target_only.load()
    long_prompt = prompt_past_window(cfg, target_dir, target_only.model.config.sliding_window)
    prompts = bench_prompts(cfg, target_dir, 4)
    jobs = [(ids, SamplingParams(max_new_tokens=8 + 6 * (i % 3)))
            for i, ids in enumerate([long_prompt, *prompts[:2], long_prompt[5:], *prompts[2:]])]  # fmt: skip
    expected = [target_only.generate_ids(ids, params)[0] for ids, params in jobs]
    for (ids, params), alone in zip(jobs, expected):
        hf = target_only.model.generate(torch.tensor([ids]), max_new_tokens=params.max_new_tokens, do_sample=False,
                                        attention_mask=torch.ones(1, len(ids)))  # fmt: skip
        assert alone == hf[0, len(ids) :].tolist()[: len(alone)], name
    drafter_dir = export_drafter(random_drafter(target_dir, cfg.data.draft_vocab_size, seed=1), tmp_path / "drafter")
    engine = make_engine(cfg, target_dir, drafter_dir, model_version="random")
    engine.load()
    assert engine.batchable, name
    batch_sizes = []
    step_batch = engine._step_batch

    def recording_step(sequences, caches):
        batch_sizes.append(len(sequences))
        return step_batch(sequences, caches)

    engine._step_batch = recording_step

    async def run_all():
        gate = asyncio.Semaphore(3)

        async def one(ids, params):
            async with gate:
                return [t async for chunk in engine.generate(ids, params) for t in chunk.token_ids]

        return await asyncio.gather(*(one(ids, params) for ids, params in jobs))

    assert asyncio.run(run_all()) == expected, name
    assert max(batch_sizes) == 3


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
