"""The vLLM engine without a server: the preflight (what vLLM's CPU build would reject late, at the first request or
minutes into start-up), the server command, the counter parsing, and `--engine vllm` on the bench and gate commands."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from conftest import TEST_CONFIG, config_overrides
from draftline.config import load_config
from draftline.engines.vllm.engine import build_server_argv, parse_spec_counters
from draftline.engines.vllm.preflight import VLLMPreflightError, check_or_raise, preflight


def write_model(root: Path, name: str, **config) -> Path:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def target(root: Path, head_dim: int = 32) -> Path:
    return write_model(root, "target", architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=96,
                       num_attention_heads=4, head_dim=head_dim, num_hidden_layers=8, vocab_size=2048,
                       max_position_embeddings=512)  # fmt: skip


def drafter(root: Path, **overrides) -> Path:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 96, "num_attention_heads": 4,
        "head_dim": 32, "target_hidden_size": 96, "vocab_size": 2048, "draft_vocab_size": 512, "target_family": "llama",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
    }  # fmt: skip
    config.update(overrides)
    return write_model(root, "drafter", **{k: v for k, v in config.items() if v is not None})


def cfg(*overrides: str):
    return load_config(None, ["engine.backend=vllm", *overrides])


def fields(findings) -> list[str]:
    return [f.field for f in findings]


def test_a_matching_pair_passes(tmp_path):
    assert preflight(cfg(), target(tmp_path), drafter(tmp_path)) == []


def test_a_gemma3_target_with_a_drafter_is_refused_before_vllm_loads_it(tmp_path):
    gemma = write_model(tmp_path, "gemma", architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=96,
                        num_attention_heads=4, head_dim=256, num_hidden_layers=8, vocab_size=2048,
                        max_position_embeddings=512)  # fmt: skip
    with pytest.raises(VLLMPreflightError, match=r"(?s)Gemma3ForCausalLM.*no EAGLE-3 capture.*fix: serve .* reference"):
        check_or_raise(cfg(), gemma, drafter(tmp_path, target_family="gemma3_text"))
    assert preflight(cfg(), gemma, None) == []  # the target alone is served


def test_head_dim_40_fails_before_the_first_request(tmp_path):
    with pytest.raises(VLLMPreflightError, match=r"head_dim 40 is not a multiple of 32.*first request"):
        check_or_raise(cfg(), target(tmp_path, head_dim=40), None)


@pytest.mark.parametrize(
    "overrides, field",
    [(["engine.speculative.eagle_topk=2", "engine.speculative.num_draft_tokens=6"], "engine.speculative.eagle_topk"),
     (["engine.speculative.num_draft_tokens=6"], "engine.speculative.num_draft_tokens"),
     (["engine.vllm.max_model_len=4096"], "engine.vllm.max_model_len")],  # fmt: skip
)
def test_speculative_settings_vllm_does_not_have(tmp_path, overrides, field):
    assert field in fields(preflight(cfg(*overrides), target(tmp_path), drafter(tmp_path)))


@pytest.mark.parametrize(
    "overrides, message",
    [({"eagle_aux_hidden_state_layer_ids": None}, "layer below the one it was trained on"),
     ({"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}, r"outside 0..6"),
     ({"target_hidden_size": 128}, "target_hidden_size=128"),
     ({"architectures": ["LlamaForCausalLM"]}, "loads EAGLE-3 Llama drafts as")],  # fmt: skip
)
def test_drafters_vllm_would_serve_wrongly(tmp_path, overrides, message):
    with pytest.raises(VLLMPreflightError, match=message) as err:
        check_or_raise(cfg(), target(tmp_path), drafter(tmp_path, **overrides))
    assert "drafter/config.json" in str(err.value) and "fix:" in str(err.value)


def test_server_command(tmp_path):
    config = cfg("engine.vllm.max_model_len=512", "engine.vllm.enforce_eager=true", "engine.speculative.num_steps=2",
                 "engine.speculative.num_draft_tokens=3")  # fmt: skip
    argv = build_server_argv(config, Path("/venv/bin/python"), tmp_path / "t", tmp_path / "d", 12345)
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "12345" and "--enforce-eager" in argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(tmp_path / "d"), "num_speculative_tokens": 2}


METRICS = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 15.0
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 45.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 21.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 11.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 3.0
"""


def test_spec_counters_from_metrics_text():
    """The format as vLLM 0.32 serves it (names and labels copied from a live /metrics; the live test reads it too)."""
    counters = parse_spec_counters(METRICS)
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (15, 45, 21)
    assert counters.accepted_per_position == [11, 7, 3]
    assert counters.mean_accept_length == pytest.approx(1 + 21 / 15)
    assert counters.minus(parse_spec_counters(METRICS)).drafts == 0


@pytest.mark.parametrize("command, module, function", [("bench", "draftline.bench.cli", "run_bench"),
                                                       ("gate", "draftline.gate", "run_gate")])  # fmt: skip
def test_bench_and_gate_commands_run_on_vllm_with_engine_vllm(monkeypatch, command, module, function):
    from draftline.cli import main

    class Reached(Exception):
        pass

    backends = []

    def record_backend(cfg, *args, **kwargs):
        backends.append(cfg.engine.backend)
        raise Reached  # the command got this far with its config; running it is test_engine_vllm's job

    monkeypatch.setattr(importlib.import_module(module), function, record_backend)
    drafter_arg = ["--drafter", "unused"] if command == "bench" else []
    with pytest.raises(Reached):
        main([command, "--engine", "vllm", *drafter_arg, "--config", str(TEST_CONFIG), *config_overrides()])
    assert backends == ["vllm"]
    with pytest.raises(SystemExit):  # argparse: not one of the registered backends
        main([command, "--engine", "vllm-gpu", "--config", str(TEST_CONFIG)])
