"""The drafter's RoPE at training time is what every peer computes from its export: SGLang's and vLLM's EAGLE-3 draft
models serving it, transformers, speculators and SpecForge loading it.

For each family's rope (default theta 1e4 and 1e6, llama3, yarn; twin and published parameters) the drafter is sized
from the family's transformers config, its export's config.json (and its speculators-format config) is written, and
q/k are rotated by the drafter (drafter/model.py) and by each peer's own code: vLLM's get_rope in .venv-vllm, SGLang's
rotary code of 0.5.6, 0.5.12 and 0.5.23 (the released wheels, unpacked by tests/engine_sources.py), transformers'
LlamaRotaryEmbedding (.venv), speculators 0.9.0's Eagle3DraftModel and SpecForge 0.2.0's LlamaAttention (their
overlays, `make peers`). They must agree to float32 rounding: YaRN's magnitude included, which the peers read from
different fields (drafter/model.py `_yarn_peer_fields`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from draftline.config import EmbeddedTargetConfig
from draftline.drafter.export import SGLANG_VERSIONS_CHECKED, config_from_hf, hf_config
from draftline.drafter.model import DrafterConfig, apply_rope, yarn_magnitude
from draftline.drafter.speculators_export import speculators_config
from draftline.target.families import build_model_config
from engine_sources import VLLM_PYTHON, peer_env, unpacked_sglang_sources

SGLANG_VERSIONS = SGLANG_VERSIONS_CHECKED
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
    """(run id, engine, interpreter, source dir, environment) for each engine run."""
    runs = [("vllm", "vllm", VLLM_PYTHON, "-", None), ("transformers", "transformers", sys.executable, "-", None)]
    runs += [(f"sglang-{v}", "sglang", sys.executable, str(sources[v]), None) for v in SGLANG_VERSIONS]
    runs += [(f"sglang-{v}-transformers5", "sglang-transformers5", sys.executable, str(sources[v]), None) for v in SGLANG_VERSIONS[1:]]
    runs += [(peer, peer, sys.executable, "-", peer_env(peer)) for peer in ("speculators", "specforge")]
    return runs


# The rotary class each engine builds per rope type (a wrong class means a field was misread, whatever the numbers).
_CLASSES = {
    "vllm": {"default": "RotaryEmbedding", "llama3": "Llama3RotaryEmbedding", "yarn": "YaRNScalingRotaryEmbedding"},
    "transformers": {t: f"LlamaRotaryEmbedding:{t}" for t in ("default", "llama3", "yarn")},
    "specforge": {"default": "LlamaRotaryEmbedding", "llama3": "LlamaRotaryEmbedding", "yarn": "LlamaYarnRotaryEmbedding"},
}
_CLASSES.update({"sglang": _CLASSES["vllm"], "sglang-transformers5": _CLASSES["vllm"], "speculators": _CLASSES["transformers"]})


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
        (export_dir / "speculators").mkdir()
        verifier = make_target().to_dict()
        (export_dir / "speculators" / "config.json").write_text(json.dumps(speculators_config(config, "float32", "verifier", verifier)))
        # Positions across the drafter's whole context, where long-wavelength scaling shows.
        positions = torch.cat([torch.arange(8), torch.randint(8, config.max_position_embeddings, (24,), generator=generator)])
        q = torch.randn(len(positions), config.num_attention_heads * config.head_dim, generator=generator)
        k = torch.randn(len(positions), config.num_key_value_heads * config.head_dim, generator=generator)
        torch.save({"positions": positions, "q": q, "k": k}, export_dir / "inputs.pt")
        cases[name] = (config, export_dir, _drafter_rotation(config, positions, q, k))
    got = {}
    for run_id, engine, python, source, env in _engine_runs(sglang_sources):
        jobs = [{"export_dir": str(d), "inputs": str(d / "inputs.pt"), "output": str(d / f"{run_id}.pt")} for _, d, _ in cases.values()]
        (root / f"{run_id}.json").write_text(json.dumps(jobs))
        done = subprocess.run([python, str(REPO / "tests" / "engine_rope_runner.py"), engine, source, str(root / f"{run_id}.json")],
                              capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
        assert done.returncode == 0, f"{run_id}:\n{done.stderr[-4000:]}"
        for name, (_, export_dir, _) in cases.items():
            got[name, run_id] = {**torch.load(export_dir / f"{run_id}.pt"), "engine": engine}
    return cases, got


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_drafter_rope_equals_every_peer(case, rotations):
    cases, got = rotations
    config, _, (want_q, want_k) = cases[case]
    rope_type = (config.rope_scaling or {}).get("rope_type", "default")
    runs = [run_id for name, run_id in got if name == case]
    assert len(runs) == 2 + 2 * len(SGLANG_VERSIONS) - 1 + 2
    for run_id in runs:
        result = got[case, run_id]
        assert result["class"] == _CLASSES[result["engine"]][rope_type], run_id
        torch.testing.assert_close(result["q"], want_q, rtol=1e-5, atol=1e-5, msg=lambda m: f"{run_id}: {m}")
        torch.testing.assert_close(result["k"], want_k, rtol=1e-5, atol=1e-5, msg=lambda m: f"{run_id}: {m}")


def test_yarn_export_writes_the_fields_peers_read_and_reads_back():
    # The target's own mscale/mscale_all_dim are not the drafter's; the export writes the values every peer turns
    # into the drafter's magnitude (SpecForge cannot load a yarn export without them).
    config = DrafterConfig.from_target(ROPE_CASES["deepseek-v3"](), draft_vocab_size=256, aux_layer_ids=[1, 3, 4])
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                   "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip
    exported = hf_config(config, "float32")
    assert exported["rope_scaling"] == {**config.rope_scaling, "mscale": 1.0, "mscale_all_dim": 0.0,
                                        "attention_factor": yarn_magnitude(40.0), "truncate": True}  # fmt: skip
    assert config_from_hf(json.loads(json.dumps(exported))) == config
    assert DrafterConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    # An export written before these fields existed reads back the same.
    assert config_from_hf({**exported, "rope_scaling": config.rope_scaling}) == config


def test_an_edited_yarn_magnitude_field_is_refused():
    config = DrafterConfig.from_target(ROPE_CASES["kimi-k2"](), draft_vocab_size=256, aux_layer_ids=[1, 3, 4])
    exported = hf_config(config, "float32")
    exported["rope_scaling"]["mscale_all_dim"] = 1.0  # the target's own value: SpecForge and SGLang 0.5.23 would scale by 1
    with pytest.raises(ValueError, match=r"config.json rope_scaling: \{'mscale_all_dim': 1.0\} would make some engine"):
        config_from_hf(exported)


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
