"""Export the drafter as one HF directory that SGLang's `LlamaForCausalLMEagle3` and vLLM's `Eagle3LlamaForCausalLM` load.

Checked by reading sglang/srt/models/llama_eagle3.py and llama.py of SGLang 0.5.6, 0.5.12 and 0.5.23
(see docs/drafter-export.md for the details):
- `load_weights` takes checkpoint names without the `model.` prefix and adds it where needed; q/k/v_proj are
  stacked into qkv_proj and gate/up_proj into gate_up_proj; names it does not know are skipped silently (so a
  test pins our key set). 0.5.12+ renames `midlayer` to `layers.0`, which keeps `midlayer.*` loadable.
- `d2t` is read as offsets: hot_token_id = d2t + arange(draft_vocab). `t2d` is skipped by the loader.
- There is no embed_tokens in our export: SGLang shares the target's embedding with the draft model.
- One directory serves SGLang and vLLM although they read aux ids differently (draftline.target.aux_layers):
  SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids`; vLLM 0.32 reads a top-level
  `eagle_aux_hidden_state_layer_ids` first and falls back to the eagle_config one. Each key holds that engine's ids.
- 0.5.6 builds fc as 3 * target_hidden_size wide regardless of the config; 0.5.12+ sizes it from the number of
  aux ids. A drafter with n_aux != 3 therefore loads only on 0.5.12+.
- `tie_word_embeddings` must be false and `draft_vocab_size` set, or SGLang uses/loads a target-vocab lm_head.
- SpecForge 0.2.0 warm-starts from the same directory (it reads SGLang's ids); `rope_scaling` carries the fields
  every peer needs to compute the drafter's rotary (drafter/model.py `exported_rope_scaling`). speculators' own
  format is drafter/speculators_export.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save

from draftline.drafter.model import DrafterConfig, Eagle3Drafter, drafter_rope_scaling, exported_rope_scaling
from draftline.target.aux_layers import DEFAULT_FAMILY, rule_for, written_aux_ids
from draftline.utils import atomic_write_bytes, atomic_write_json, read_json

SGLANG_VERSIONS_CHECKED = ("0.5.6", "0.5.12", "0.5.23")
# The SGLang version whose aux id rule the export follows; versions reading ids the same way are listed as supported.
SGLANG_EXPORT_VERSION = "0.5.23"
VLLM_VERSIONS_CHECKED = ("0.32.0",)
# SpecForge warm-starts from the hf export and hands eagle_config's ids to the SGLang it pins (0.2.0: sglang==0.5.14).
SPECFORGE_VERSION_CHECKED = "0.2.0"
SPECFORGE_SGLANG_VERSION = "0.5.14"
EXPORT_FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
META_FILE = "draftline.json"
CHECKPOINT_STATE_FILE = "drafter_state.pt"
CHECKPOINT_CONFIG_FILE = "drafter_config.json"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"drafter weights are {dtype}; export supports {sorted(_DTYPES)}")


def expected_weight_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes SGLang's LlamaForCausalLMEagle3.load_weights consumes (0.5.6 .. 0.5.23)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_width = config.num_attention_heads * head_dim
    kv_width = config.num_key_value_heads * head_dim
    return {
        "fc.weight": (hidden, config.num_aux * config.target_hidden_size),
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.self_attn.q_proj.weight": (q_width, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_width, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_width, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, q_width),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "midlayer.mlp.gate_proj.weight": (config.intermediate_size, hidden),
        "midlayer.mlp.up_proj.weight": (config.intermediate_size, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, config.intermediate_size),
        "norm.weight": (hidden,),
        "lm_head.weight": (config.draft_vocab_size, hidden),
        "d2t": (config.draft_vocab_size,),
        "t2d": (config.target_vocab_size,),
    }


def hf_config(config: DrafterConfig, torch_dtype: str) -> dict[str, Any]:
    """config.json for SGLang and vLLM (a transformers LlamaConfig plus the EAGLE-3 fields)."""
    family, capture_ids = config.target_family, config.aux_layer_ids
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": exported_rope_scaling(config.rope_scaling),
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.target_vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "target_family": family,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": written_aux_ids(family, "sglang", SGLANG_EXPORT_VERSION, capture_ids),
            "use_aux_hidden_state": True,
        },
        "eagle_aux_hidden_state_layer_ids": written_aux_ids(family, "vllm", VLLM_VERSIONS_CHECKED[-1], capture_ids),
        "torch_dtype": torch_dtype,
    }


def sglang_versions_supported(config: DrafterConfig) -> list[str]:
    """Checked versions that load this export (fc width) and read its aux ids as the export version does."""
    family, ids = config.target_family, config.aux_layer_ids
    written = written_aux_ids(family, "sglang", SGLANG_EXPORT_VERSION, ids)
    return [
        v for v in SGLANG_VERSIONS_CHECKED
        if (v != "0.5.6" or config.num_aux == 3) and written_aux_ids(family, "sglang", v, ids) == written
    ]


def specforge_supported(config: DrafterConfig) -> bool:
    """SpecForge builds fc for 3 aux states, and must read the SGLang ids as the export version does."""
    family, ids = config.target_family, config.aux_layer_ids
    written = written_aux_ids(family, "sglang", SGLANG_EXPORT_VERSION, ids)
    return config.num_aux == 3 and written_aux_ids(family, "sglang", SPECFORGE_SGLANG_VERSION, ids) == written


def export_tensors(model: Eagle3Drafter, dtype: Optional[str]) -> tuple[dict[str, torch.Tensor], str]:
    """The drafter's tensors under SGLang's checkpoint names, float ones cast to `dtype` (default: the model's own)."""
    if dtype is None:
        dtype = _dtype_name(next(model.parameters()).dtype)
    if dtype not in _DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    tensors = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().to("cpu")
        if tensor.is_floating_point():
            tensor = tensor.to(_DTYPES[dtype])
        tensors[name] = tensor.contiguous()
    expected = expected_weight_shapes(model.config)
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        raise ValueError(f"drafter state does not match SGLang's checkpoint layout: got {got}, expected {expected}")
    return tensors, dtype


def write_export(
    out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], config_json: dict[str, Any], meta: dict[str, Any]
) -> Path:
    """model.safetensors, config.json, then draftline.json (meta + weights_sha256 + time): its presence marks a complete export."""
    out = Path(out_dir)
    weights = save(tensors, metadata={"format": "pt"})
    atomic_write_bytes(out / WEIGHTS_FILE, weights)
    atomic_write_json(out / "config.json", config_json)
    # weights_sha256 is checked by the registry before a version is promoted or served (registry.verify_export).
    meta = {**meta, "weights_sha256": hashlib.sha256(weights).hexdigest(), "exported_at_unix_s": int(time.time())}
    atomic_write_json(out / META_FILE, meta)
    return out


def export_drafter(
    model: Eagle3Drafter, out_dir: str | os.PathLike, meta: Optional[dict[str, Any]] = None, dtype: Optional[str] = None
) -> Path:
    """Write config.json, model.safetensors and draftline.json (meta + what this export was checked against).

    dtype: "float32" | "bfloat16" | "float16" for the float weights (default: the model's own dtype).
    draftline.json is written last, so its presence marks a complete export.
    """
    cfg = model.config
    tensors, dtype = export_tensors(model, dtype)
    export_meta = {
        **(meta or {}),
        "format_version": EXPORT_FORMAT_VERSION,
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "drafter_config": cfg.to_dict(),
        "dtype": dtype,
        "sglang_versions_checked": list(SGLANG_VERSIONS_CHECKED),
        "sglang_versions_supported": sglang_versions_supported(cfg),
        "vllm_versions_checked": list(VLLM_VERSIONS_CHECKED),
        "specforge_versions_supported": [SPECFORGE_VERSION_CHECKED] if specforge_supported(cfg) else [],
    }
    return write_export(out_dir, tensors, hf_config(cfg, dtype), export_meta)


def read_export_meta(export_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(export_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {export_dir} is not a complete draftline export")
    return read_json(path)


def config_from_hf(hf: dict[str, Any]) -> DrafterConfig:
    if hf.get("architectures") != ["LlamaForCausalLMEagle3"] or hf.get("num_hidden_layers") != 1:
        raise ValueError(
            f"config.json describes {hf.get('architectures')} with {hf.get('num_hidden_layers')} layers; "
            "expected a 1-layer LlamaForCausalLMEagle3 drafter"
        )
    family = hf.get("target_family", DEFAULT_FAMILY)
    return DrafterConfig(
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        intermediate_size=hf["intermediate_size"],
        draft_vocab_size=hf["draft_vocab_size"],
        target_vocab_size=hf["vocab_size"],
        target_hidden_size=hf["target_hidden_size"],
        aux_layer_ids=tuple(
            rule_for(family, "sglang", SGLANG_EXPORT_VERSION).to_capture(hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        ),
        target_family=family,
        rms_norm_eps=hf["rms_norm_eps"],
        rope_theta=hf["rope_theta"],
        max_position_embeddings=hf["max_position_embeddings"],
        rope_scaling=drafter_rope_scaling(hf.get("rope_scaling"), "config.json rope_scaling"),
    )


def load_drafter(export_dir: str | os.PathLike, device: str | torch.device = "cpu") -> Eagle3Drafter:
    """Load an export back (weights in their stored dtype), in eval mode."""
    export_dir = Path(export_dir)
    config_path, weights_path = export_dir / "config.json", export_dir / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: {export_dir} is not a drafter export")
    config = config_from_hf(read_json(config_path))
    tensors = load_file(str(weights_path))
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    expected = expected_weight_shapes(config)
    if got != expected:
        raise ValueError(f"{weights_path}: tensors {got} do not match config.json, which implies {expected}")
    model = Eagle3Drafter(config)
    dtype = tensors["fc.weight"].dtype
    model.to(dtype)
    model.load_state_dict(tensors, strict=True)
    model.set_vocab(tensors["d2t"], tensors["t2d"])
    return model.to(device).eval()


def save_drafter_checkpoint(model: Eagle3Drafter, ckpt_dir: str | os.PathLike) -> Path:
    """What `export_from_checkpoint` reads: drafter_state.pt (state_dict) + drafter_config.json."""
    ckpt = Path(ckpt_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    tmp = ckpt / f".{CHECKPOINT_STATE_FILE}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, ckpt / CHECKPOINT_STATE_FILE)
    atomic_write_json(ckpt / CHECKPOINT_CONFIG_FILE, model.config.to_dict())
    return ckpt


def load_drafter_checkpoint(ckpt_dir: str | os.PathLike) -> Eagle3Drafter:
    """The drafter of a training checkpoint directory (drafter_state.pt + drafter_config.json), weights as trained."""
    ckpt = Path(ckpt_dir)
    state_path, config_path = ckpt / CHECKPOINT_STATE_FILE, ckpt / CHECKPOINT_CONFIG_FILE
    for path in (state_path, config_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: a drafter checkpoint directory holds "
                f"{CHECKPOINT_STATE_FILE} and {CHECKPOINT_CONFIG_FILE}"
            )
    config = DrafterConfig.from_dict(json.loads(config_path.read_text()))
    state = torch.load(state_path, map_location="cpu", weights_only=True)
    model = Eagle3Drafter(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{state_path} does not fit {config_path}: {err}") from None
    model.set_vocab(state["d2t"], state["t2d"])
    return model.to(state["fc.weight"].dtype)


def export_from_checkpoint(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    meta: Optional[dict[str, Any]] = None,
    dtype: Optional[str] = None,
) -> Path:
    return export_drafter(load_drafter_checkpoint(ckpt_dir), out_dir, meta=meta, dtype=dtype)
