"""Export the drafter in speculators' own checkpoint format (vLLM's `speculators` library, read in 0.9.0).

speculators' `Eagle3Converter` turns an SGLang-style EAGLE-3 directory into this format, but it reads neither aux-id
key of such a config.json: without `--eagle-aux-hidden-state-layer-ids` it writes none, and speculators, then vLLM,
fall back to their default layers. This module writes the format directly, with the ids the drafter was trained on:
- config.json: an `Eagle3SpeculatorConfig` (speculators/models/eagle3/config.py): `speculators_model_type: eagle3`,
  the draft layer as `transformer_layer_config` (a Llama config with transformers 5 `rope_parameters`),
  `speculators_config` (greedy proposals, the verifier's name or path and architectures), and
  `eagle_aux_hidden_state_layer_ids`, read as vLLM reads them (`hidden_states[k]`, the input of layer k): vLLM's
  speculators config (transformers_utils/configs/speculators/algos.py) copies the key into its Eagle-3 config, and
  speculators' own `resolve_target_layer_ids` takes ids in 0..n (n: the final hidden state), as vLLM captures them.
- Every EAGLE-3 flag is written: vLLM defaults an absent `norm_before_residual` to true, speculators to false.
- model.safetensors: SGLang's names with `midlayer.` renamed `layers.0.` (what the converter saves; vLLM loads both).
tests/integration/test_peer_loaders.py loads it with speculators' own classes and compares it with the converter's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from draftline.drafter.export import (
    EXPORT_FORMAT_VERSION,
    VLLM_VERSIONS_CHECKED,
    export_tensors,
    write_export,
)
from draftline.drafter.model import DrafterConfig, Eagle3Drafter, exported_rope_scaling
from draftline.target.aux_layers import check_capture_ids, written_aux_ids

SPECULATORS_VERSION_CHECKED = "0.9.0"
# speculators' converter default; vLLM takes it as num_speculative_tokens when it serves the speculator directly.
SPECULATIVE_TOKENS = 3


def transformer_layer_config(config: DrafterConfig, dtype: str) -> dict[str, Any]:
    """The draft decoder layer as speculators (and vLLM) build it: a transformers 5 LlamaConfig."""
    rope_parameters = {"rope_type": "default", **(exported_rope_scaling(config.rope_scaling) or {})}
    rope_parameters["rope_theta"] = config.rope_theta
    return {
        "model_type": "llama",
        "vocab_size": config.target_vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }


def speculators_config(
    config: DrafterConfig, dtype: str, verifier_name_or_path: str, verifier_hf_config: dict[str, Any]
) -> dict[str, Any]:
    """config.json of the speculators format; verifier_hf_config is the target's config.json (its layers bound the ids)."""
    verifier_text = verifier_hf_config.get("text_config") or verifier_hf_config
    check_capture_ids(
        config.aux_layer_ids, int(verifier_text["num_hidden_layers"]), f"the drafter's aux_layer_ids (verifier {verifier_name_or_path})"
    )
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION_CHECKED,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_hf_config.get("architectures") or [])},
        },
        "transformer_layer_config": transformer_layer_config(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": written_aux_ids(
            config.target_family, "vllm", VLLM_VERSIONS_CHECKED[-1], config.aux_layer_ids
        ),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }


def export_speculators(
    model: Eagle3Drafter,
    out_dir: str | os.PathLike,
    verifier_name_or_path: str,
    verifier_hf_config: dict[str, Any],
    meta: Optional[dict[str, Any]] = None,
    dtype: Optional[str] = None,
) -> Path:
    """Write config.json, model.safetensors (speculators' names) and draftline.json (written last)."""
    cfg = model.config
    tensors, dtype = export_tensors(model, dtype)
    tensors = {name.replace("midlayer.", "layers.0.", 1): tensor for name, tensor in tensors.items()}
    export_meta = {
        **(meta or {}),
        "format": "speculators",
        "format_version": EXPORT_FORMAT_VERSION,
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "drafter_config": cfg.to_dict(),
        "dtype": dtype,
        "speculators_version_checked": SPECULATORS_VERSION_CHECKED,
        "vllm_versions_checked": list(VLLM_VERSIONS_CHECKED),
    }
    config_json = speculators_config(cfg, dtype, verifier_name_or_path, verifier_hf_config)
    return write_export(out_dir, tensors, config_json, export_meta)
