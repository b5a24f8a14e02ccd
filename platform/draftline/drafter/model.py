"""The EAGLE-3 draft model: one Llama decoder layer over [target embedding ; hidden].

Maths per position (the same as SGLang's `LlamaForCausalLMEagle3`, checked against 0.5.6, 0.5.12 and 0.5.23):

    hidden   = fc(cat(aux states))              # first step only; later steps feed hidden_out back
    x        = cat(input_layernorm(embeds), hidden_norm(hidden))        # 2H wide
    h        = hidden + o_proj(attention(q/k/v_proj(x)))                 # residual is the *un-normed* hidden
    out      = h + mlp(post_attention_layernorm(h))                      # hidden_out (pre-norm), fed to the next step
    logits   = lm_head(norm(out))                                        # over the draft vocabulary

Module names (`midlayer.*`, `fc`, `norm`, `lm_head`, buffers `d2t`, `t2d`) are SGLang's checkpoint names, so
`state_dict()` is the exported weight set. The target's embedding is not part of the drafter: callers pass
`input_embeds` computed with the frozen target embedding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from draftline.target.aux_layers import DEFAULT_FAMILY, check_capture_ids, family_of


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] = ()  # layer-OUTPUT ids (draftline.target.aux_layers)
    target_family: str = DEFAULT_FAMILY  # decides the aux ids each engine is told (draftline.target.aux_layers)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # None (plain RoPE) or the export's `rope_scaling` dict: {"rope_type": "linear" | "llama3" | "yarn", ...}
    rope_scaling: Optional[dict] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        problems = []
        if self.rope_scaling is not None:
            missing = sorted(set(_ROPE_SCALING_KEYS.get(self.rope_scaling.get("rope_type"), ())) - set(self.rope_scaling))
            if self.rope_scaling.get("rope_type") not in _ROPE_SCALING_KEYS:
                problems.append(f"rope_scaling {self.rope_scaling}: rope_type must be one of {sorted(_ROPE_SCALING_KEYS)}")
            elif missing or set(self.rope_scaling) - {"rope_type", *_ROPE_SCALING_KEYS[self.rope_scaling["rope_type"]]}:
                problems.append(
                    f"rope_scaling {self.rope_scaling}: a {self.rope_scaling['rope_type']} rope_scaling has exactly "
                    f"the keys {sorted(_ROPE_SCALING_KEYS[self.rope_scaling['rope_type']])}"
                )
        if not self.aux_layer_ids:
            problems.append("aux_layer_ids is empty: give the target layer-output ids the aux states came from")
        elif list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            problems.append(
                f"aux_layer_ids {list(self.aux_layer_ids)} must be strictly increasing: the engines concatenate the "
                "captured states in layer order, whatever order the config lists them in"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            problems.append(
                f"draft_vocab_size {self.draft_vocab_size} must be in [1, target_vocab_size={self.target_vocab_size}]"
            )
        if problems:
            raise ValueError("invalid DrafterConfig: " + "; ".join(problems))

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["aux_layer_ids"] = list(self.aux_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DrafterConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"DrafterConfig: unknown fields {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_target(
        cls,
        target_hf_config: Any,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        num_attention_heads: Optional[int] = None,
        intermediate_size: Optional[int] = None,
    ) -> "DrafterConfig":
        """Size the drafter after a transformers Llama-style target config.

        hidden_size must equal the target's: the drafter consumes the target's own token embedding.
        aux_layer_ids are layer-OUTPUT ids (HF `hidden_states[i+1]`), checked by draftline.target.aux_layers.
        """
        hidden_size = int(target_hf_config.hidden_size)
        num_layers = int(target_hf_config.num_hidden_layers)
        rope_theta, rope_scaling = _rope_of(target_hf_config)
        check_capture_ids([int(i) for i in aux_layer_ids], num_layers)
        target_heads = int(target_hf_config.num_attention_heads)
        target_kv_heads = int(getattr(target_hf_config, "num_key_value_heads", None) or target_heads)
        # MLA targets (DeepSeek-V3, Kimi-K2) have no single head width (their `head_dim` is the rotary part):
        # the drafter, a plain Llama layer, splits hidden_size evenly.
        is_mla = getattr(target_hf_config, "kv_lora_rank", None) is not None
        target_head_dim = int((not is_mla and getattr(target_hf_config, "head_dim", None)) or hidden_size // target_heads)
        if num_attention_heads is None:
            heads, kv_heads, head_dim = target_heads, target_kv_heads, target_head_dim
        else:
            if hidden_size % num_attention_heads:
                raise ValueError(
                    f"num_attention_heads {num_attention_heads} does not divide hidden_size {hidden_size}; "
                    "pick a divisor (train.num_attention_heads)"
                )
            heads = int(num_attention_heads)
            kv_heads = target_kv_heads if heads % target_kv_heads == 0 else heads
            head_dim = hidden_size // heads
        return cls(
            hidden_size=hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(intermediate_size or target_hf_config.intermediate_size),
            draft_vocab_size=int(draft_vocab_size),
            target_vocab_size=int(target_hf_config.vocab_size),
            target_hidden_size=hidden_size,
            aux_layer_ids=tuple(int(i) for i in aux_layer_ids),
            target_family=family_of(target_hf_config),
            rms_norm_eps=float(target_hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            max_position_embeddings=int(target_hf_config.max_position_embeddings),
            rope_scaling=rope_scaling,
        )


# The keys of each rope_scaling the drafter trains with (DrafterConfig.rope_scaling). Every engine reads these the
# same way (checked numerically against SGLang 0.5.6/0.5.12/0.5.23 and vLLM 0.32 by tests/integration/test_drafter_rope.py).
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"),
}
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}


def yarn_magnitude(factor: float) -> float:
    """YaRN's scale on cos and sin as the drafter trains with it: 0.1 ln(factor) + 1 (1 for factor <= 1)."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn_peer_fields(rope_scaling: dict) -> dict[str, Any]:
    """The yarn fields some peer reads with a default of its own, at the values that give every peer the drafter's
    magnitude (tests/integration/test_drafter_rope.py runs each peer's rotary code on the export):
    - mscale 1, mscale_all_dim 0: SpecForge 0.2.0 and SGLang 0.5.23 scale by yarn_get_mscale(f, mscale) /
      yarn_get_mscale(f, mscale_all_dim) = (0.1 ln f + 1) / 1 (SpecForge fails when they are absent); vLLM 0.32 and
      transformers take that ratio only when both are non-zero, else 0.1 ln f + 1; SGLang 0.5.6/0.5.12 ignore them.
    - attention_factor: vLLM and transformers (speculators' rotary) use it in place of any mscale.
    - truncate: vLLM, transformers and SGLang 0.5.12+ read it (default true); SGLang 0.5.6 and SpecForge always truncate.
    SGLang's own `attn_factor` and `extrapolation_factor` are left out: transformers flags them as unknown keys, and
    SGLang's defaults (1) are the drafter's.
    """
    return {"mscale": 1.0, "mscale_all_dim": 0.0, "attention_factor": yarn_magnitude(rope_scaling["factor"]), "truncate": True}


_PEER_FIELDS = {"yarn": _yarn_peer_fields}


def exported_rope_scaling(rope_scaling: Optional[dict]) -> Optional[dict]:
    """DrafterConfig.rope_scaling as an export writes it: plus every field a peer reads with a default of its own."""
    if rope_scaling is None or rope_scaling["rope_type"] not in _PEER_FIELDS:
        return rope_scaling
    return {**rope_scaling, **_PEER_FIELDS[rope_scaling["rope_type"]](rope_scaling)}


def drafter_rope_scaling(exported: Optional[dict], where: str) -> Optional[dict]:
    """The inverse of exported_rope_scaling; peer fields at other values (an edited export) are refused, naming `where`.

    Exports written before the peer fields existed carry none of them and read back the same."""
    if exported is None or exported.get("rope_type") not in _PEER_FIELDS:
        return exported
    expected = _PEER_FIELDS[exported["rope_type"]](exported)
    rope_scaling = {k: v for k, v in exported.items() if k not in expected}
    wrong = {k: v for k, v in exported.items() if k in expected and v != expected[k]}
    if wrong:
        raise ValueError(
            f"{where}: {wrong} would make some engine scale the drafter's rotary differently from training; "
            f"a draftline export has {expected} (re-export the drafter)"
        )
    return rope_scaling


def _rope_of(hf_config: Any) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling for the drafter) from a target config (transformers 5 `rope_parameters`, 4.x keys;
    the full-attention layers' for a target that ropes per layer type).

    The target's own YaRN magnitude (`mscale`, `mscale_all_dim`, `attention_factor`) is not the drafter's: the
    engines disagree on it (SGLang 0.5.6/0.5.12 ignore mscale, 0.5.23, vLLM and SpecForge take a ratio), so the
    drafter always trains with 0.1 ln(factor) + 1, and its export writes the fields that make every peer compute
    that (exported_rope_scaling). The drafter is trained with what it is served with, which need not be the
    target's own attention scaling.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if not isinstance(params, dict):
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    # RoPE per layer type (Gemma 3: local theta 1e4, global 1e6): the drafter attends over the whole context, as
    # the target's full-attention layers do, so it takes theirs.
    params = params.get("full_attention", params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == "default":
        return theta, None
    if rope_type not in _ROPE_SCALING_KEYS:
        raise ValueError(
            f"target rope_type {rope_type!r} is not supported by the drafter; supported: default, "
            f"{', '.join(sorted(_ROPE_SCALING_KEYS))}"
        )
    values = {**(_YARN_DEFAULTS if rope_type == "yarn" else {}), **params}
    missing = [k for k in _ROPE_SCALING_KEYS[rope_type] if k not in values]
    if missing:
        raise ValueError(f"target rope_parameters {params}: a {rope_type} RoPE needs {missing}")
    scaling = {"rope_type": rope_type}
    for key in _ROPE_SCALING_KEYS[rope_type]:
        scaling[key] = int(values[key]) if key == "original_max_position_embeddings" else float(values[key])
    return theta, scaling


def rope_frequencies(head_dim: int, theta: float, rope_scaling: Optional[dict]) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim/2] float32, magnitude applied to cos and sin), as SGLang's and vLLM's get_rope compute."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    factor = rope_scaling["factor"]
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    original = rope_scaling["original_max_position_embeddings"]
    if rope_type == "llama3":
        # Long wavelengths are divided by factor, short ones kept, the band between interpolated smoothly.
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        middle = (wavelen <= original / low) & (wavelen >= original / high)
        return torch.where(middle, interpolated, scaled), 1.0
    # yarn: dimensions that turn fewer than beta_slow times over the original context are interpolated,
    # more than beta_fast times extrapolated, linear in between; cos/sin are scaled by 0.1 ln(factor) + 1.
    def correction_dim(turns: float) -> float:
        return (head_dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(rope_scaling["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(rope_scaling["beta_slow"])), head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, yarn_magnitude(factor)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def apply_rope(
    x: torch.Tensor, position_ids: torch.Tensor, theta: float, rope_scaling: Optional[dict] = None
) -> torch.Tensor:
    """Llama (neox-style, rotate-half) rotary embedding. x: [B, heads, T, D]; position_ids: [B, T]."""
    head_dim = x.shape[-1]
    inv_freq, magnitude = rope_frequencies(head_dim, theta, rope_scaling)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq.to(x.device)  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, D]
    cos, sin = angles.cos() * magnitude, angles.sin() * magnitude
    x32 = x.float()
    first, second = x32[..., : head_dim // 2], x32[..., head_dim // 2 :]
    rotated = torch.cat([-second, first], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        width_in = 2 * config.hidden_size  # [embeds ; hidden]
        self.q_proj = nn.Linear(width_in, config.num_attention_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(width_in, config.num_key_value_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(width_in, config.num_key_value_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)


class DraftMLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """The single decoder layer, split in two so the TTT loss can put its own attention in between."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def project_qkv(
        self, input_embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q [B, heads, T, D], k and v [B, kv_heads, T, D]; q and k already rotated."""
        batch, length, _ = hidden.shape
        x = torch.cat([self.input_layernorm(input_embeds), self.hidden_norm(hidden)], dim=-1)
        attn = self.self_attn
        head_dim = self.config.head_dim
        q = attn.q_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
        theta, scaling = self.config.rope_theta, self.config.rope_scaling
        return apply_rope(q, position_ids, theta, scaling), apply_rope(k, position_ids, theta, scaling), v

    def finish(self, attn_heads: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn_heads [B, heads, T, D] -> hidden_out [B, T, H] (pre-norm, what the next step consumes)."""
        batch, _, length, _ = attn_heads.shape
        h = residual + self.self_attn.o_proj(attn_heads.transpose(1, 2).reshape(batch, length, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


def expand_kv_heads(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, kv_heads, S, D] -> [B, heads, S, D]; query head i reads kv head i // (heads / kv_heads), as in Llama."""
    repeats = num_heads // kv.shape[1]
    return kv if repeats == 1 else kv.repeat_interleave(repeats, dim=1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention. q [B,h,T,D], k/v [B,kv,S,D], allowed bool broadcastable to [B,h,T,S]."""
    k = expand_kv_heads(k, q.shape[1])
    v = expand_kv_heads(v, q.shape[1])
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)


class DrafterKVCache:
    """Keys (rotated) and values of the drafter's one layer, for token-by-token drafting.

    Entries are in append order and a new token attends to every earlier entry plus itself, i.e. a chain
    (topk=1). `crop(length)` drops rejected draft tokens after verification.
    """

    def __init__(self) -> None:
        self.keys: Optional[torch.Tensor] = None  # [B, kv_heads, S, D]
        self.values: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"DrafterKVCache.crop({length}): cache holds {self.length} entries")
        if self.keys is not None:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.num_aux * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = DraftDecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # Identity vocab until a real mapping is loaded: draft id i is target id i.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary (d2t int64 offsets [Vd], t2d bool [Vt]) after checking it is consistent."""
        cfg = self.config
        if tuple(d2t.shape) != (cfg.draft_vocab_size,) or tuple(t2d.shape) != (cfg.target_vocab_size,):
            raise ValueError(
                f"vocab shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match the drafter "
                f"(draft_vocab_size={cfg.draft_vocab_size}, target_vocab_size={cfg.target_vocab_size})"
            )
        target_ids = torch.arange(cfg.draft_vocab_size) + d2t.cpu().long()
        expected = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
        expected[target_ids] = True
        if not torch.equal(expected, t2d.cpu().bool()):
            raise ValueError("d2t and t2d disagree: t2d must be True exactly at the target ids draft + d2t[draft]")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def fuse_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, n_aux * target_hidden] -> [B, T, H]."""
        expected = self.config.num_aux * self.config.target_hidden_size
        if aux_hidden.shape[-1] != expected:
            raise ValueError(
                f"aux_hidden has width {aux_hidden.shape[-1]}, expected n_aux*target_hidden = {expected} "
                f"(aux_layer_ids {list(self.config.aux_layer_ids)})"
            )
        return self.fc(aux_hidden)

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_out))

    def forward(
        self,
        input_embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Optional[DrafterKVCache] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (draft_logits [B, T, Vd], hidden_out [B, T, H]).

        hidden: fused aux states (`fuse_aux`) or the drafter's own previous hidden_out.
        Without a cache the T positions attend causally to each other. With a cache the new keys are appended
        and new token i attends to every cached entry plus new tokens 0..i.
        """
        if hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"hidden has width {hidden.shape[-1]} but the drafter is {self.config.hidden_size} wide; "
                "pass raw aux states through fuse_aux first"
            )
        batch, length, _ = hidden.shape
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(batch, length)
        q, k, v = self.midlayer.project_qkv(input_embeds, hidden, position_ids)
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.append(k, v)
        query_index = torch.arange(length, device=q.device)[:, None] + past
        key_index = torch.arange(past + length, device=q.device)[None, :]
        hidden_out = self.midlayer.finish(attend(q, k, v, key_index <= query_index), residual=hidden)
        return self.logits(hidden_out), hidden_out

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
