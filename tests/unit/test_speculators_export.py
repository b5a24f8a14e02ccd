"""`draftline export --format speculators`: the file layout and the refusals. Loading it with speculators' own classes
(and vLLM's config reader) is tests/integration/test_peer_loaders.py."""

from __future__ import annotations

import json

import torch
from drafter_helpers import tiny_drafter
from safetensors.torch import load_file

from draftline.cli import main as draftline_main
from draftline.drafter.export import read_export_meta, save_drafter_checkpoint


def _verifier(tmp_path, num_layers: int):
    verifier = tmp_path / "target"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                      "num_hidden_layers": num_layers}))  # fmt: skip
    return verifier


def test_speculators_format_carries_the_trained_ids_and_the_weights(tmp_path, capsys):
    model = tiny_drafter(seed=5)  # aux_layer_ids (1, 2, 3): layer outputs
    ckpt = save_drafter_checkpoint(model, tmp_path / "ckpt")
    out = tmp_path / "speculators"
    code = draftline_main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--format", "speculators",
                           "--verifier", str(_verifier(tmp_path, 6)), "--dtype", "bfloat16"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # vLLM's hidden_states[k]: outputs + 1
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(tmp_path / "target"), "architectures": ["LlamaForCausalLM"]}
    assert config["norm_before_residual"] is False  # vLLM's default without the key is true
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["dtype"]) == ("llama", 1, "bfloat16")
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    weights = load_file(str(out / "model.safetensors"))
    want = {k.replace("midlayer.", "layers.0.", 1): v for k, v in model.state_dict().items()}
    assert weights.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(weights[name], tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor), name
    meta = read_export_meta(out)
    assert (meta["format"], meta["aux_layer_ids"], meta["dtype"]) == ("speculators", [1, 2, 3], "bfloat16")


def test_speculators_format_refuses_a_missing_verifier_and_ids_beyond_it(tmp_path, capsys):
    ckpt = save_drafter_checkpoint(tiny_drafter(), tmp_path / "ckpt")
    args = ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out"), "--format", "speculators"]
    assert draftline_main(args) == 2
    assert "--format speculators needs --verifier" in capsys.readouterr().err
    assert draftline_main([*args, "--verifier", "org/model"]) == 2
    assert "--verifier-config (default --verifier) org/model: no such config.json" in capsys.readouterr().err
    # A 4-layer target cannot have given layer output 3 (the engines capture the input of layer id + 1).
    assert draftline_main([*args, "--verifier", "org/model", "--verifier-config", str(_verifier(tmp_path, 4))]) == 2
    assert "aux_layer_ids (verifier org/model) [1, 2, 3]: ids [3] are outside 0..2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
