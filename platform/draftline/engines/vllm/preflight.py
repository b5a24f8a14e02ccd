"""Checks of a vLLM launch that vLLM itself makes late (at the first request, or minutes into start-up) or never.

Read from vLLM 0.32.0 (CPU build) and seen on this machine:
- CPU attention has no kernel for head_dim 40 and fails at the FIRST REQUEST (`Unsupported CPU attention
  configuration: head_dim=40`), not at start-up: target and drafter head_dim must be multiples of 32 on CPU.
- EAGLE-3 in vLLM is a chain of `num_speculative_tokens` drafts: there is no tree (eagle_topk > 1), and the verify
  width is always num_speculative_tokens + 1, so SGLang's num_draft_tokens must be num_steps + 1.
- vLLM reads the draft's top-level `eagle_aux_hidden_state_layer_ids` (else eagle_config's) as HF hidden_states[k]:
  an export carrying only SGLang's layer-output ids feeds the drafter the layer below the one it was trained on,
  silently (draftline.target.aux_layers decides the ids; drafter/export.py writes both keys).
- target_hidden_size, vocab_size and len(d2t) that do not fit the target fail only after the target has loaded.
- A max_model_len beyond the target's max_position_embeddings fails at start-up, after vLLM has imported everything.
- A target class without vLLM's EAGLE-3 interface (Gemma3ForCausalLM) fails once the target has loaded: "Model does
  not support EAGLE3 interface but aux_hidden_state_outputs was requested".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from draftline.config import ConfigError, DraftlineConfig, cpu_head_dim_problem
from draftline.engines.sglang.checkpoint import read_checkpoint
from draftline.target.aux_layers import AuxLayerIdError, capture_ids_from_written, family_of

EAGLE3_DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Target classes of vLLM 0.32 that do not implement SupportsEagle3 (no aux hidden-state capture), among the families
# draftline builds twins of; tests/integration/test_aux_layers.py asks vLLM's own classes.
NO_EAGLE3_ARCHITECTURES = ("Gemma3ForCausalLM",)


@dataclass(frozen=True)
class Finding:
    field: str  # the config field or file the problem is in
    message: str
    fix: str

    def __str__(self) -> str:
        return f"error: {self.field}: {self.message}\n  fix: {self.fix}"


class VLLMPreflightError(ConfigError):
    def __init__(self, findings: list[Finding]) -> None:
        self.findings = findings
        super().__init__("vLLM would fail or serve wrongly:\n" + "\n".join(str(f) for f in findings))


def _head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def preflight(cfg: DraftlineConfig, target_dir: Path, drafter_dir: Optional[Path]) -> list[Finding]:
    """Every error found (empty: vLLM is expected to start and serve this pair as trained)."""
    findings: list[Finding] = []
    error = lambda field, message, fix: findings.append(Finding(field, message, fix))  # noqa: E731
    target = read_checkpoint(target_dir)
    if target.config is None:
        error("target", f"{target_dir} {target.problem}", "point the engine at a local HF model directory")
        return findings
    on_cpu = cfg.engine.device == "cpu"
    models = [("target", target_dir, target.config)]
    draft = read_checkpoint(drafter_dir) if drafter_dir is not None else None
    if draft is not None and draft.config is None:
        error("drafter", f"{drafter_dir} {draft.problem}", "pass a draftline export directory (config.json + model.safetensors)")
        return findings
    if draft is not None:
        models.append(("drafter", drafter_dir, draft.config))
    if on_cpu:
        for role, path, config in models:
            problem = cpu_head_dim_problem(_head_dim(config), f"{path}/config.json:")
            if problem:
                error(f"{role} head_dim", problem, "rebuild the model with head_dim 32 or 64 (target.embedded.head_dim)")
    max_len, positions = cfg.engine.vllm.max_model_len, target.config.get("max_position_embeddings")
    if max_len is not None and positions is not None and max_len > positions:
        error("engine.vllm.max_model_len", f"{max_len} exceeds the target's max_position_embeddings {positions}",
              f"set engine.vllm.max_model_len <= {positions} (or leave it empty)")  # fmt: skip
    if draft is None:
        return findings

    spec = cfg.engine.speculative
    if spec.algorithm.upper() != "EAGLE3":
        error("engine.speculative.algorithm", f"{spec.algorithm!r}: the vLLM engine serves EAGLE-3 drafters only",
              "set engine.speculative.algorithm: EAGLE3")  # fmt: skip
    if spec.eagle_topk != 1:
        error("engine.speculative.eagle_topk", f"{spec.eagle_topk}: vLLM's EAGLE-3 drafts a chain, not a tree",
              "set engine.speculative.eagle_topk: 1 for engine.backend vllm")  # fmt: skip
    if spec.num_draft_tokens != spec.num_steps + 1:
        error("engine.speculative.num_draft_tokens",
              f"{spec.num_draft_tokens} with num_steps {spec.num_steps}: vLLM verifies num_speculative_tokens + 1 = "
              f"{spec.num_steps + 1} tokens per step and has no separate setting",
              f"set engine.speculative.num_draft_tokens: {spec.num_steps + 1}")  # fmt: skip
    target_architectures = target.config.get("architectures") or []
    unsupported = [a for a in target_architectures if a in NO_EAGLE3_ARCHITECTURES]
    if unsupported:
        error("target", f"{target_dir}/config.json architectures {unsupported}: vLLM {cfg.engine.vllm.version} has no "
              "EAGLE-3 capture for this class and fails after loading the target",
              "serve this target's drafter with engine.backend reference")  # fmt: skip
    config = draft.config
    where = f"{drafter_dir}/config.json"
    if draft.architecture not in EAGLE3_DRAFT_ARCHITECTURES:
        error(where, f"architectures {draft.architectures}: vLLM loads EAGLE-3 Llama drafts as {EAGLE3_DRAFT_ARCHITECTURES}",
              "re-export the drafter with draftline (architectures: [LlamaForCausalLMEagle3])")  # fmt: skip
    for draft_key, target_key in (("target_hidden_size", "hidden_size"), ("vocab_size", "vocab_size")):
        want, have = config.get(draft_key), target.config.get(target_key)
        if want is not None and have is not None and want != have:
            error(where, f"{draft_key}={want} but the target's {target_key} is {have}: vLLM fails after loading the target",
                  "serve the drafter with the target it was trained for")  # fmt: skip
    draft_vocab = config.get("draft_vocab_size")
    if draft.d2t_length is not None and draft_vocab is not None and draft.d2t_length != draft_vocab:
        error(where, f"draft_vocab_size={draft_vocab} but d2t has {draft.d2t_length} entries", "re-export the drafter")
    num_layers = int(target.config["num_hidden_layers"])
    top_level = config.get("eagle_aux_hidden_state_layer_ids")
    if top_level is None and (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") is not None:
        error(where, "no top-level eagle_aux_hidden_state_layer_ids: vLLM would read eagle_config's layer-output ids "
              "(SGLang's meaning) as hidden_states[k] and feed the drafter the layer below the one it was trained on",
              "re-export the drafter with this draftline (it writes the ids for both engines)")  # fmt: skip
    elif top_level is not None:
        family = config.get("target_family") or family_of(target.config)
        try:
            capture_ids_from_written(family, "vllm", cfg.engine.vllm.version, num_layers, top_level,
                                     where=f"{where} eagle_aux_hidden_state_layer_ids")  # fmt: skip
        except AuxLayerIdError as err:
            error(where, str(err), "re-export the drafter for this target")
    return findings


def check_or_raise(cfg: DraftlineConfig, target_dir: Path, drafter_dir: Optional[Path]) -> None:
    findings = preflight(cfg, target_dir, drafter_dir)
    if findings:
        raise VLLMPreflightError(findings)
