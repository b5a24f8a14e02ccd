"""Eagle3Drafter: config sizing, vocab mapping, and incremental (KV cache) decoding == full forward."""

from __future__ import annotations

import pytest
import torch
from drafter_helpers import random_inputs, tiny_config, tiny_drafter
from transformers import LlamaConfig

from draftline.drafter.model import DrafterConfig, DrafterKVCache


def tiny_llama_config(**overrides) -> LlamaConfig:
    fields = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def test_from_target_copies_the_target_shape():
    config = DrafterConfig.from_target(tiny_llama_config(), draft_vocab_size=100, aux_layer_ids=[1, 2, 4])
    assert (config.hidden_size, config.target_hidden_size) == (64, 64)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert (config.intermediate_size, config.target_vocab_size, config.draft_vocab_size) == (96, 300, 100)
    assert config.rope_theta == 5000.0
    assert config.max_position_embeddings == 256
    assert config.aux_layer_ids == (1, 2, 4)


def test_a_target_roping_per_layer_type_gives_the_drafter_its_full_attention_rope():
    from transformers import Gemma3TextConfig

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}  # fmt: skip
    target = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=256, rope_parameters=rope)  # fmt: skip
    config = DrafterConfig.from_target(target, draft_vocab_size=100, aux_layer_ids=[1, 2, 3])
    assert (config.rope_theta, config.rope_scaling, config.head_dim) == (1000000.0, None, 256)


def test_from_target_overrides_and_validation():
    target = tiny_llama_config()
    config = DrafterConfig.from_target(
        target, draft_vocab_size=100, aux_layer_ids=[1, 2, 4], num_attention_heads=8, intermediate_size=40
    )
    assert (config.num_attention_heads, config.head_dim, config.num_key_value_heads) == (8, 8, 2)
    assert config.intermediate_size == 40
    assert config.aux_layer_ids == (1, 2, 4)
    with pytest.raises(ValueError, match=r"outside 0..4 for a 6-layer target"):
        DrafterConfig.from_target(target, draft_vocab_size=100, aux_layer_ids=[1, 2, 5])
    with pytest.raises(ValueError, match="strictly ascending"):
        DrafterConfig.from_target(target, draft_vocab_size=100, aux_layer_ids=[3, 1, 2])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DrafterConfig.from_target(target, draft_vocab_size=301, aux_layer_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="does not divide"):
        DrafterConfig.from_target(target, draft_vocab_size=100, aux_layer_ids=[1, 2, 3], num_attention_heads=5)


def test_config_dict_round_trip_and_unknown_fields():
    config = tiny_config()
    assert DrafterConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown fields"):
        DrafterConfig.from_dict({**config.to_dict(), "num_layers": 2})


def test_draft_to_target_uses_offsets_and_set_vocab_checks_consistency():
    model = tiny_drafter()
    draft_ids = torch.arange(model.config.draft_vocab_size)
    target_ids = model.draft_to_target(draft_ids)
    assert torch.equal(model.t2d.nonzero().squeeze(1), target_ids)
    broken_t2d = model.t2d.clone()
    broken_t2d[target_ids[0]] = False
    with pytest.raises(ValueError, match="disagree"):
        model.set_vocab(model.d2t.clone(), broken_t2d)


def test_forward_rejects_unfused_aux():
    model = tiny_drafter()
    embeds, aux, _ = random_inputs(model.config, batch=1, length=3)
    with pytest.raises(ValueError, match="fuse_aux"):
        model(embeds, aux, torch.arange(3))


@torch.no_grad()
def test_kv_cache_token_by_token_equals_full_forward():
    model = tiny_drafter()
    batch, length = 2, 9
    embeds, aux, _ = random_inputs(model.config, batch, length)
    hidden = model.fuse_aux(aux)
    positions = torch.arange(length)
    full_logits, full_hidden = model(embeds, hidden, positions)

    cache = DrafterKVCache()
    step_logits, step_hidden = [], []
    for t in range(length):
        logits, out = model(embeds[:, t : t + 1], hidden[:, t : t + 1], positions[t : t + 1], cache=cache)
        step_logits.append(logits)
        step_hidden.append(out)
    assert cache.length == length
    torch.testing.assert_close(torch.cat(step_logits, 1), full_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(step_hidden, 1), full_hidden, atol=1e-5, rtol=0)

    # Prefill a chunk, then crop back and redo the tail: results must not depend on the rejected entries.
    cache = DrafterKVCache()
    model(embeds[:, :5], hidden[:, :5], positions[:5], cache=cache)
    model(torch.randn_like(embeds[:, 5:7]), hidden[:, 5:7], positions[5:7], cache=cache)
    cache.crop(5)
    tail_logits, _ = model(embeds[:, 5:], hidden[:, 5:], positions[5:], cache=cache)
    torch.testing.assert_close(tail_logits, full_logits[:, 5:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="crop"):
        cache.crop(length + 1)


@torch.no_grad()
def test_positions_matter():
    model = tiny_drafter()
    embeds, aux, _ = random_inputs(model.config, batch=1, length=4)
    hidden = model.fuse_aux(aux)
    logits, _ = model(embeds, hidden, torch.arange(4))
    shifted, _ = model(embeds, hidden, torch.arange(4) + 3)
    # RoPE is relative: a uniform shift keeps causal attention (nearly) unchanged...
    torch.testing.assert_close(logits, shifted, atol=1e-4, rtol=0)
    # ...but different relative distances change it.
    spread, _ = model(embeds, hidden, torch.tensor([0, 2, 5, 9]))
    assert not torch.allclose(logits[:, 1:], spread[:, 1:], atol=1e-4)


@torch.no_grad()
def test_layer_matches_transformers_llama_attention_and_mlp():
    """Same maths as transformers' Llama attention (RoPE, GQA) with a 2H-wide input, which is SGLang's layer."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRotaryEmbedding

    model = tiny_drafter()
    cfg = model.config
    hf_config = LlamaConfig(
        hidden_size=2 * cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        vocab_size=cfg.target_vocab_size,
    )
    hf_config._attn_implementation = "eager"
    hf_attention = LlamaAttention(hf_config, layer_idx=0)
    layer = model.midlayer
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(hf_attention, name).weight.copy_(getattr(layer.self_attn, name).weight)
    hf_attention.o_proj = layer.self_attn.o_proj
    mlp_config = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size)
    hf_mlp = LlamaMLP(mlp_config)
    hf_mlp.load_state_dict(layer.mlp.state_dict())

    batch, length = 2, 6
    embeds, aux, _ = random_inputs(cfg, batch, length)
    hidden = model.fuse_aux(aux)
    positions = torch.arange(length).unsqueeze(0).expand(batch, length)
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
    cos_sin = LlamaRotaryEmbedding(hf_config)(x, positions)
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    attn_out, _ = hf_attention(x, position_embeddings=cos_sin, attention_mask=causal)
    after_attn = hidden + attn_out
    expected_hidden = after_attn + hf_mlp(layer.post_attention_layernorm(after_attn))

    logits, hidden_out = model(embeds, hidden, positions)
    torch.testing.assert_close(hidden_out, expected_hidden, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, model.lm_head(model.norm(expected_hidden)), atol=1e-5, rtol=0)
