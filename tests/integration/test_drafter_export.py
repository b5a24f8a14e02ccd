"""Export for SGLang's LlamaForCausalLMEagle3 (0.5.6 / 0.5.12 / 0.5.23), load back, checkpoint -> export CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from drafter_helpers import random_inputs, tiny_drafter
from safetensors import safe_open
from transformers import AutoConfig

from draftline.cli import main as draftline_main
from draftline.drafter.export import (
    export_drafter,
    export_from_checkpoint,
    load_drafter,
    read_export_meta,
    save_drafter_checkpoint,
)

# Derived by reading LlamaForCausalLMEagle3.load_weights in sglang 0.5.6, 0.5.12 and 0.5.23 for the tiny config
# (H=32, 4 heads x 8, 2 kv heads, MLP 48, 3 aux states of width 32, draft vocab 24, target vocab 40):
# q/k/v_proj and gate/up_proj are stacked by the loader, "model." is prefixed where needed, "midlayer" is
# renamed to "layers.0" in 0.5.12+, d2t becomes hot_token_id, t2d is skipped, unknown names are dropped silently.
SGLANG_KEYS_AND_SHAPES = {
    "fc.weight": (32, 96),
    "midlayer.input_layernorm.weight": (32,),
    "midlayer.hidden_norm.weight": (32,),
    "midlayer.self_attn.q_proj.weight": (32, 64),
    "midlayer.self_attn.k_proj.weight": (16, 64),
    "midlayer.self_attn.v_proj.weight": (16, 64),
    "midlayer.self_attn.o_proj.weight": (32, 32),
    "midlayer.post_attention_layernorm.weight": (32,),
    "midlayer.mlp.gate_proj.weight": (48, 32),
    "midlayer.mlp.up_proj.weight": (48, 32),
    "midlayer.mlp.down_proj.weight": (32, 48),
    "norm.weight": (32,),
    "lm_head.weight": (24, 32),
    "d2t": (24,),
    "t2d": (40,),
}


def _logits(model, seed=3):
    embeds, aux, _ = random_inputs(model.config, batch=2, length=6, seed=seed)
    embeds, aux = embeds.to(model.fc.weight.dtype), aux.to(model.fc.weight.dtype)
    with torch.no_grad():
        return model(embeds, model.fuse_aux(aux), torch.arange(6))[0]


def test_safetensors_keys_and_shapes_match_sglang_loader(tmp_path):
    out = export_drafter(tiny_drafter(), tmp_path / "export", meta={"target_fingerprint": "abc"})
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        d2t, t2d = handle.get_tensor("d2t"), handle.get_tensor("t2d")
    assert shapes == SGLANG_KEYS_AND_SHAPES
    assert not any("embed_tokens" in name for name in shapes)
    # SGLang: hot_token_id = d2t + arange(draft_vocab) must be the target ids the draft vocab covers.
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert torch.equal(d2t + torch.arange(d2t.shape[0]), t2d.nonzero().squeeze(1))


def test_config_json_is_an_eagle3_llama_config(tmp_path):
    model = tiny_drafter()
    out = export_drafter(model, tmp_path / "export", meta={})
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
    hf = AutoConfig.from_pretrained(out)
    assert hf.model_type == "llama"
    assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (32, 4, 2, 8)
    assert (hf.num_hidden_layers, hf.intermediate_size, hf.vocab_size) == (1, 48, 40)
    assert (hf.draft_vocab_size, hf.target_hidden_size) == (24, 32)
    assert hf.tie_word_embeddings is False
    assert raw["torch_dtype"] == "float32"


def test_load_export_gives_identical_logits_and_meta(tmp_path):
    model = tiny_drafter(seed=5)
    meta = {"target_fingerprint": "fp-123", "dataset_hash": "ds-9", "metrics": {"acc_0": 0.5}}
    out = export_drafter(model, tmp_path / "export", meta=meta)
    loaded = load_drafter(out)
    assert loaded.config == model.config
    assert torch.equal(_logits(loaded), _logits(model))
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    written = read_export_meta(out)
    assert written["target_fingerprint"] == "fp-123" and written["dataset_hash"] == "ds-9"
    assert written["metrics"] == {"acc_0": 0.5}
    assert written["aux_layer_ids"] == [1, 2, 3]
    assert written["sglang_versions_checked"] == ["0.5.6", "0.5.12", "0.5.23"]
    assert written["sglang_versions_supported"] == ["0.5.6", "0.5.12", "0.5.23"]


def test_bfloat16_export_and_four_aux_states(tmp_path):
    model = tiny_drafter(aux_layer_ids=(1, 2, 3, 4))
    out = export_drafter(model, tmp_path / "export", meta={}, dtype="bfloat16")
    loaded = load_drafter(out)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.fc.weight.shape == (32, 128)
    assert loaded.d2t.dtype == torch.int64
    assert torch.equal(_logits(loaded), _logits(model.to(torch.bfloat16)))
    # SGLang 0.5.6 builds fc for exactly 3 aux states.
    assert read_export_meta(out)["sglang_versions_supported"] == ["0.5.12", "0.5.23"]


def test_load_rejects_weights_that_do_not_fit_the_config(tmp_path):
    out = export_drafter(tiny_drafter(), tmp_path / "export", meta={})
    raw = json.loads((out / "config.json").read_text())
    raw["intermediate_size"] = 64
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="do not match config.json"):
        load_drafter(out)
    with pytest.raises(FileNotFoundError, match="not a drafter export"):
        load_drafter(tmp_path / "nowhere")


def test_checkpoint_export_via_cli(tmp_path, capsys):
    model = tiny_drafter(seed=7)
    ckpt = save_drafter_checkpoint(model, tmp_path / "ckpt")
    meta_file = tmp_path / "meta.json"
    meta_file.write_text(json.dumps({"dataset_hash": "ds-1"}))
    out_dir = tmp_path / "export"
    code = draftline_main(["export", "--checkpoint", str(ckpt), "--out", str(out_dir), "--meta", str(meta_file)])
    assert code == 0
    assert str(out_dir) in capsys.readouterr().out
    assert torch.equal(_logits(load_drafter(out_dir)), _logits(model))
    assert read_export_meta(out_dir)["dataset_hash"] == "ds-1"

    code = draftline_main(["export", "--checkpoint", str(tmp_path / "missing"), "--out", str(out_dir)])
    assert code == 2
    assert "drafter_state.pt" in capsys.readouterr().err


def test_export_from_checkpoint_rejects_mismatched_state(tmp_path):
    ckpt = save_drafter_checkpoint(tiny_drafter(), tmp_path / "ckpt")
    state = torch.load(ckpt / "drafter_state.pt", weights_only=True)
    del state["norm.weight"]
    torch.save(state, ckpt / "drafter_state.pt")
    with pytest.raises(ValueError, match="does not fit"):
        export_from_checkpoint(ckpt, tmp_path / "export")


def test_export_files_are_readable_by_other_users_under_a_022_umask(tmp_path):
    """Fault 10: files came out 0600 (mkstemp's mode), so an engine running as another user could not read them.
    Run in a fresh process so that the umask the writer reads is the one set here."""
    code = ("import os, sys; os.umask(0o022); from drafter_helpers import tiny_drafter; "
            "from draftline.drafter.export import export_drafter; export_drafter(tiny_drafter(), sys.argv[1], meta={})")
    tests_dir = str(Path(__file__).parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "export")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "export").iterdir()}
    assert modes and set(modes.values()) == {"0o644"}, modes
