"""The drafter's RoPE at training time is what SGLang's and vLLM's EAGLE-3 draft models compute serving its export.

For each family's rope (default theta 1e4 and 1e6, llama3, yarn; twin and published parameters) the drafter is sized
from the family's transformers config, its export's config.json is written, and q/k are rotated three ways: by the
drafter (drafter/model.py), by vLLM's own get_rope in .venv-vllm, and by SGLang's own rotary code of 0.5.6, 0.5.12 and
0.5.23 (the released wheels, unpacked by tests/engine_sources.py). They must agree to float32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from draftline.config import EmbeddedTargetConfig
from draftline.drafter.export import SGLANG_VERSIONS_CHECKED, hf_config
from draftline.drafter.model import DrafterConfig, apply_rope
from draftline.target.families import build_model_config
from engine_sources import unpacked_sglang_sources

SGLANG_VERSIONS = SGLANG_VERSIONS_CHECKED
VLLM_PYTHON = os.environ.get("DRAFTLINE_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
SPECIAL = {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _twin(family: str, **dims):
    emb = EmbeddedTargetConfig(family=family, hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, **dims)
    return build_model_config(emb, SPECIAL)


def _published(family: str, rope_parameters: dict, max_positions: int):
    config = _twin(family)
    config.rope_parameters = rope_parameters
    config.max_position_embeddings = max_positions
    return config


ROPE_CASES = {
    "llama-default": lambda: _twin("llama"),
    "qwen3-theta1e6": lambda: _twin("qwen3"),
    "llama3.1-twin": lambda: _twin("llama3.1"),
    "llama3.1-8b": lambda: _published("llama3.1", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}, 131072),  # fmt: skip
    "deepseek-v3-twin": lambda: _twin("deepseek-v3"),
    "deepseek-v3": lambda: _published("deepseek-v3", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "original_max_position_embeddings": 4096}, 163840),  # fmt: skip
    "kimi-k2": lambda: _published("deepseek-v3", {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                                  "beta_fast": 1, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                  "original_max_position_embeddings": 4096}, 131072),  # fmt: skip
}


@pytest.fixture(scope="module")
def sglang_sources():
    prefixes = ("sglang/srt/layers/rotary_embedding", "sglang/srt/models/llama.py")
    return {v: unpacked_sglang_sources(v, prefixes) for v in SGLANG_VERSIONS}


def _drafter_rotation(config: DrafterConfig, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    def rotate(x, heads):
        x = x.view(len(positions), heads, config.head_dim).transpose(0, 1)[None]  # [1, heads, T, D]
        out = apply_rope(x, positions[None], config.rope_theta, config.rope_scaling)
        return out[0].transpose(0, 1).reshape(len(positions), -1)

    return rotate(q, config.num_attention_heads), rotate(k, config.num_key_value_heads)


def _engine_runs(sources):
    """(run id, engine, interpreter, source dir) for each engine run."""
    runs = [("vllm", "vllm", VLLM_PYTHON, "-")]
    runs += [(f"sglang-{v}", "sglang", sys.executable, str(sources[v])) for v in SGLANG_VERSIONS]
    runs += [(f"sglang-{v}-transformers5", "sglang-transformers5", sys.executable, str(sources[v])) for v in SGLANG_VERSIONS[1:]]
    return runs


@pytest.fixture(scope="module")
def rotations(tmp_path_factory, sglang_sources):
    """Every case rotated by the drafter and by each engine (one engine process for all cases: vLLM imports slowly)."""
    root = tmp_path_factory.mktemp("rope")
    cases = {}
    generator = torch.Generator().manual_seed(0)
    for name, make_target in ROPE_CASES.items():
        config = DrafterConfig.from_target(make_target(), draft_vocab_size=256, aux_layer_ids=[1, 3, 4])
        export_dir = root / name
        export_dir.mkdir()
        (export_dir / "config.json").write_text(json.dumps(hf_config(config, "float32")))
        # Positions across the drafter's whole context, where long-wavelength scaling shows.
        positions = torch.cat([torch.arange(8), torch.randint(8, config.max_position_embeddings, (24,), generator=generator)])
        q = torch.randn(len(positions), config.num_attention_heads * config.head_dim, generator=generator)
        k = torch.randn(len(positions), config.num_key_value_heads * config.head_dim, generator=generator)
        torch.save({"positions": positions, "q": q, "k": k}, export_dir / "inputs.pt")
        cases[name] = (config, export_dir, _drafter_rotation(config, positions, q, k))
    got = {}
    for run_id, engine, python, source in _engine_runs(sglang_sources):
        jobs = [{"export_dir": str(d), "inputs": str(d / "inputs.pt"), "output": str(d / f"{run_id}.pt")} for _, d, _ in cases.values()]
        (root / f"{run_id}.json").write_text(json.dumps(jobs))
        done = subprocess.run([python, str(REPO / "tests" / "engine_rope_runner.py"), engine, source, str(root / f"{run_id}.json")],
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        assert done.returncode == 0, f"{run_id}:\n{done.stderr[-4000:]}"
        for name, (_, export_dir, _) in cases.items():
            got[name, run_id] = torch.load(export_dir / f"{run_id}.pt")
    return cases, got


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_drafter_rope_equals_sglang_and_vllm(case, rotations):
    cases, got = rotations
    config, _, (want_q, want_k) = cases[case]
    if config.rope_scaling is None:
        expected_class = "RotaryEmbedding"
    else:
        expected_class = {"llama3": "Llama3RotaryEmbedding", "yarn": "YaRNScalingRotaryEmbedding"}[config.rope_scaling["rope_type"]]
    runs = [run_id for name, run_id in got if name == case]
    assert len(runs) == 1 + 2 * len(SGLANG_VERSIONS) - 1
    for run_id in runs:
        result = got[case, run_id]
        assert result["class"] == expected_class, run_id
        torch.testing.assert_close(result["q"], want_q, rtol=1e-5, atol=1e-5, msg=lambda m: f"{run_id}: {m}")
        torch.testing.assert_close(result["k"], want_k, rtol=1e-5, atol=1e-5, msg=lambda m: f"{run_id}: {m}")


def test_yarn_export_drops_the_keys_engines_disagree_on():
    # SGLang 0.5.6/0.5.12 ignore mscale/mscale_all_dim, 0.5.23 and vLLM take their ratio: the export must not carry them.
    config = DrafterConfig.from_target(ROPE_CASES["deepseek-v3"](), draft_vocab_size=256, aux_layer_ids=[1, 3, 4])
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                   "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip
    assert hf_config(config, "float32")["rope_scaling"] == config.rope_scaling
    assert DrafterConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_unsupported_rope_type_names_the_supported_ones():
    target = _twin("llama")
    target.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported by the drafter; supported: default, linear, llama3, yarn"):
        DrafterConfig.from_target(target, draft_vocab_size=256, aux_layer_ids=[1, 3, 4])


def test_scaled_rope_differs_from_plain_rope_where_it_should():
    """Guards the equality test against a vacuous pass: llama3 scaling changes long wavelengths only."""
    config = DrafterConfig.from_target(ROPE_CASES["llama3.1-8b"](), draft_vocab_size=256, aux_layer_ids=[1, 3, 4])
    x = torch.randn(1, 1, 2, config.head_dim)
    positions = torch.tensor([[3, 100000]])
    scaled = apply_rope(x, positions, config.rope_theta, config.rope_scaling)
    plain = apply_rope(x, positions, config.rope_theta, None)
    assert not torch.allclose(scaled, plain)
    short = config.head_dim // 4  # the fastest-turning frequencies are kept as they are
    torch.testing.assert_close(scaled[..., :short], plain[..., :short])
