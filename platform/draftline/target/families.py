"""Target families: the transformers config of an embedded target or shape twin, one entry per family.

A shape twin is a small model of a production family: the same transformers model class, RoPE type and scaling,
GQA ratio, qk-norm, tied embeddings, MoE routing and shared experts, MLA ranks and dense-first layers as the
published model, with every width scaled down to train on 2 CPU cores. Each entry names the published model whose
semantics it copies; the scaled-down numbers keep that model's ratios where a ratio is what the engines see.

Sizes shared by every family (hidden size, layers, attention heads, head_dim, vocabulary) come from
`target.embedded`; everything family-specific lives here, so a config only names the family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from draftline.config import EmbeddedTargetConfig


@dataclass(frozen=True)
class Family:
    architecture: str  # the transformers model class (config.json "architectures")
    model_type: str
    published: str  # the model whose config semantics the twin copies
    build: Callable[["EmbeddedTargetConfig", dict[str, Any]], Any]  # -> a transformers PretrainedConfig


def _common(emb: "EmbeddedTargetConfig", special: dict[str, Any]) -> dict[str, Any]:
    return dict(
        vocab_size=special["vocab_size"],
        hidden_size=emb.hidden_size,
        intermediate_size=emb.intermediate_size,
        num_hidden_layers=emb.num_layers,
        num_attention_heads=emb.num_attention_heads,
        num_key_value_heads=emb.num_key_value_heads,
        head_dim=emb.head_dim,
        max_position_embeddings=emb.max_position_embeddings,
        bos_token_id=special["bos_token_id"],
        eos_token_id=special["eos_token_id"],
        pad_token_id=special["pad_token_id"],
    )


def _llama(emb, special):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(emb, special), rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip


def _llama31(emb, special):
    from transformers import LlamaConfig

    # Llama-3.1: llama3 frequency scaling, theta 5e5. The published original_max_position_embeddings (8192) is
    # 1/16 of its context (131072); the twin keeps that ratio so the scaled band holds wavelengths it sees.
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": max(16, emb.max_position_embeddings // 16)}  # fmt: skip
    return LlamaConfig(**_common(emb, special), rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=rope)


def _qwen3(emb, special):
    from transformers import Qwen3Config

    # Qwen3-8B: qk-norm (built into Qwen3Attention), theta 1e6, untied embeddings (the <=4B sizes tie them).
    return Qwen3Config(**_common(emb, special), rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False)  # fmt: skip


def _qwen3_moe(emb, special):
    from transformers import Qwen3MoeConfig

    # Qwen3-30B-A3B: 128 experts, 8 routed per token, normalised top-k, no shared expert, every layer sparse.
    # The twin: 8 experts, 2 per token (the same 1/16 fraction), expert width = intermediate_size / 4.
    return Qwen3MoeConfig(**_common(emb, special), rms_norm_eps=1e-6, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=emb.intermediate_size // 4,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip


def _deepseek_v3(emb, special):
    from transformers import DeepseekV3Config

    # DeepSeek-V3 / Kimi-K2: MLA (q_lora 1536, kv_lora 512, nope 128 + rope 64, v 128), 256 routed experts
    # (8 per token, 8 groups, top-4 groups, sigmoid scores with a correction bias), 1 shared expert, the first 3
    # layers dense, YaRN x40 over 4096 positions. The twin keeps nope = v = 2 x rope with rope = head_dim (q/k
    # heads 96 wide, v 64: multiples of 32), 1 shared expert and 8 routed (2 per token, 4 groups, top-2 groups),
    # the first layer dense, YaRN x4 over max_positions/4.
    rope_dim = emb.head_dim
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": emb.max_position_embeddings // 4}  # fmt: skip
    common = _common(emb, special)
    del common["head_dim"]  # MLA: the head widths below replace it
    return DeepseekV3Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=rope,
                            q_lora_rank=emb.hidden_size // 2, kv_lora_rank=emb.hidden_size // 4,
                            qk_nope_head_dim=2 * rope_dim, qk_rope_head_dim=rope_dim, v_head_dim=2 * rope_dim,
                            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                            moe_intermediate_size=emb.intermediate_size // 4, first_k_dense_replace=1,
                            routed_scaling_factor=2.5, norm_topk_prob=True, num_mtp_layers=0)  # fmt: skip


def sliding_window_of(emb: "EmbeddedTargetConfig") -> int:
    """The twins' attention window: 1/16 of their context, so that a bench prompt and its reply outgrow it (the
    published windows, 512 to 1024 of 32K to 128K for Gemma 3 and 128 of 128K for gpt-oss, would be a few tokens)."""
    return emb.max_position_embeddings // 16


def _gemma3(emb, special):
    from transformers import Gemma3TextConfig

    # google/gemma-3-1b-it (Gemma3ForCausalLM, text only): 5 sliding-window layers to 1 global, local RoPE theta 1e4
    # and global 1e6, head_dim 256 decoupled from hidden (4 heads, 1 KV head), query scaled by 1/sqrt(256), pre- and
    # post-norms around attention and MLP, embeddings scaled by sqrt(hidden) and tied to the LM head, GELU-tanh.
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}  # fmt: skip
    return Gemma3TextConfig(**_common(emb, special), rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=rope,
                            hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=emb.head_dim,
                            sliding_window=sliding_window_of(emb), sliding_window_pattern=6)  # fmt: skip


def _gpt_oss(emb, special):
    from transformers import GptOssConfig

    # openai/gpt-oss-20b: sliding-window (128) and full attention alternating (even layers slide), a learned sink
    # logit per head, attention biases, 32 experts with 4 routed per token (clamped SwiGLU, biases), YaRN x32 over
    # 4096 positions, untied. The twin: 16 experts with 2 per token (the same 1/8), expert width = intermediate_size,
    # YaRN x32 over max_positions/32.
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": emb.max_position_embeddings // 32}  # fmt: skip
    return GptOssConfig(**_common(emb, special), rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=rope,
                        sliding_window=sliding_window_of(emb), num_local_experts=16, num_experts_per_tok=2,
                        attention_bias=True, swiglu_limit=7.0)  # fmt: skip


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", "the embedded default (Llama, default RoPE)", _llama),
    "llama3.1": Family("LlamaForCausalLM", "llama", "meta-llama/Llama-3.1-8B-Instruct", _llama31),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", "Qwen/Qwen3-8B", _qwen3),
    "qwen3-moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen/Qwen3-30B-A3B", _qwen3_moe),
    "deepseek-v3": Family("DeepseekV3ForCausalLM", "deepseek_v3", "deepseek-ai/DeepSeek-V3 (and moonshotai/Kimi-K2)", _deepseek_v3),
    "gemma3": Family("Gemma3ForCausalLM", "gemma3_text", "google/gemma-3-1b-it", _gemma3),
    "gpt-oss": Family("GptOssForCausalLM", "gpt_oss", "openai/gpt-oss-20b", _gpt_oss),
}


def served_head_dims(config) -> list[int]:
    """The attention head widths an engine's kernels see: q/k and v for MLA, else head_dim."""
    if getattr(config, "kv_lora_rank", None) is not None:
        return [config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim]
    return [config.head_dim]


def build_model_config(emb: "EmbeddedTargetConfig", special: dict[str, Any]):
    """The transformers config of the embedded target of family `emb.family`.

    `special`: vocab_size and the bos/eos/pad token ids of the tokenizer trained for it.
    """
    config = FAMILIES[emb.family].build(emb, special)
    config.architectures = [FAMILIES[emb.family].architecture]
    return config
