"""sglang-command and check-sglang-args against SGLang's own argument code (the interpreters `make sglang` builds).

- every production config's generated command is accepted by the pinned release's prepare_server_args /
  check_server_args, on a scratch target holding the config's shapes and an exported-draft stand-in;
- check-sglang-args reports SGLang's own exception in the preflight's format (flag, reason, fix, file:line).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftline.config import load_config
from draftline.engines.sglang.args import flag_table_for
from draftline.engines.sglang.launch import build_launch_argv
from draftline.engines.sglang.preflight import preflight_report
from draftline.engines.sglang.real import find_installation, run_sglang_checks, sglang_root

REPO = Path(__file__).resolve().parents[2]
PRODUCTION_CONFIGS = sorted(
    p for p in (REPO / "configs").glob("*.yaml") if load_config(p).engine.backend == "sglang"
)
pytestmark = pytest.mark.sglang


def installation(version: str):
    found = find_installation(version)
    assert found is not None, f"SGLang {version} is not installed under {sglang_root()}: run `make sglang`"
    return found


def scratch_models(cfg, root: Path) -> tuple[Path, Path]:
    """config.json of the config's target family and shapes, and a draft with d2t for its draft vocab."""
    root.mkdir(parents=True, exist_ok=True)
    t = cfg.target
    is_deepseek = t.num_layers > 40  # kimi-k2.5: DeepSeek-V3 architecture (MLA + MoE)
    target_config = {
        "architectures": ["DeepseekV3ForCausalLM" if is_deepseek else "LlamaForCausalLM"],
        "model_type": "deepseek_v3" if is_deepseek else "llama",
        "hidden_size": t.hidden_size, "num_hidden_layers": t.num_layers, "vocab_size": t.vocab_size,
        "num_attention_heads": 64 if is_deepseek else 32, "num_key_value_heads": 64 if is_deepseek else 8,
        "intermediate_size": 18432 if is_deepseek else 14336, "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    }  # fmt: skip
    if is_deepseek:
        target_config.update({"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                              "v_head_dim": 128, "n_routed_experts": 384, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                              "first_k_dense_replace": 1, "n_shared_experts": 1})  # fmt: skip
    target, draft = root / "target", root / "draft"
    target.mkdir()
    draft.mkdir()
    (target / "config.json").write_text(json.dumps(target_config))
    draft_vocab = cfg.data.draft_vocab_size
    draft_config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": t.hidden_size,
        "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": t.vocab_size, "draft_vocab_size": draft_vocab, "target_hidden_size": t.hidden_size,
        "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.extract.aux_layer_ids)},
    }  # fmt: skip
    (draft / "config.json").write_text(json.dumps(draft_config))
    save_file({"d2t": torch.zeros(draft_vocab, dtype=torch.int64)}, str(draft / "model.safetensors"))
    return target, draft


def test_there_are_production_configs():
    names = {p.stem for p in PRODUCTION_CONFIGS}
    assert {"llama3.1-8b-4xgpu", "kimi-k2.5"} <= names


def test_generated_commands_are_accepted_by_the_pinned_sglang(tmp_path):
    by_version: dict[str, list[tuple[str, list[str]]]] = {}
    for config in PRODUCTION_CONFIGS:
        cfg = load_config(config)
        target, draft = scratch_models(cfg, tmp_path / config.stem)
        by_version.setdefault(cfg.engine.sglang.version, []).append((config.stem, build_launch_argv(cfg, target, draft)))
    for version, commands in by_version.items():
        report = run_sglang_checks([argv for _, argv in commands], installation(version), flag_table_for(version))
        assert report.results == [None] * len(commands), list(zip(commands, report.results))


def test_cuda_graph_option_follows_the_release(tmp_path):
    cfg = load_config(REPO / "configs/llama3.1-8b-4xgpu.yaml", ["engine.sglang.version=0.5.13"])
    target, draft = scratch_models(cfg, tmp_path)
    assert "--cuda-graph-max-bs" in build_launch_argv(cfg, target, draft)
    cfg = load_config(REPO / "configs/llama3.1-8b-4xgpu.yaml", ["engine.sglang.version=0.5.23"])
    argv = build_launch_argv(cfg, target, draft)
    assert "--cuda-graph-max-bs-decode" in argv and "--cuda-graph-max-bs" not in argv


def test_check_reports_sglang_own_exception_with_fix_and_location(tmp_path):
    target, draft = scratch_models(load_config(REPO / "configs/llama3.1-8b-4xgpu.yaml"), tmp_path)
    argv = ["python", "-m", "sglang.launch_server", "--model-path", str(target), "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", str(draft), "--speculative-num-draft-tokens", "16"]  # fmt: skip
    report = preflight_report(argv, "0.5.23", sglang="required")
    own = report.findings[0]
    assert own.rule == "sglang" and own.level == "error" and own.phase == "server-args"
    assert own.where.startswith("sglang/srt/arg_groups/speculative_hook.py:")
    assert "AssertionError" in own.message and "speculative_num_draft_tokens is None" in own.message
    assert "--speculative-num-draft-tokens" in own.flags
    assert own.fix.startswith("add --speculative-num-steps 15")
    assert "SGLang's own checks: ran: rejected" in report.applied
    accepted = preflight_report([*argv[:-1], "17", "--speculative-num-steps", "16", "--speculative-eagle-topk", "1"], "0.5.23", sglang="required")
    assert not [f for f in accepted.findings if f.level == "error"]
    assert "accepted by prepare_server_args" in accepted.applied
