"""Each peer tool loads draftline's exports with its own code and computes what draftline's drafter computes.

For the Llama-3.1, Qwen3 and DeepSeek-V3/Kimi (YaRN) shape twins (configs/twins/) a random drafter of the twin's
shape (no training: these are loader checks) is exported twice: the HF directory (SGLang, vLLM, SpecForge) and the
speculators format (`export_speculators`). It is trained on aux ids other than the engines' defaults, so a tool that
ignores the ids in the export captures other layers and the test says so. tests/peer_loader_runner.py loads them with
speculators 0.9.0 and SpecForge 0.2.0 (their overlays, `make peers`): weights bit-equal, draft logits within float32
rounding of draftline's (argmax equal), the aux ids each tool resolves equal to the ones its engine must be told.
SGLang's and vLLM's rotary code and aux-id rules are checked by tests/integration/test_drafter_rope.py and tests/integration/test_aux_layers.py,
a live vLLM load by tests/integration/test_engine_vllm.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, twin_config
from draftline.drafter.export import SGLANG_EXPORT_VERSION, VLLM_VERSIONS_CHECKED, export_drafter
from draftline.drafter.model import DrafterConfig
from draftline.drafter.speculators_export import export_speculators
from draftline.target.aux_layers import written_aux_ids
from draftline.target.families import build_model_config
from drafter_helpers import random_drafter
from engine_sources import VLLM_PYTHON, peer_env

TWINS = ("llama3.1-8b-4xgpu", "qwen3-8b", "kimi-k2.5")
# Layer-output ids of an 8-layer twin, not the engines' default [1, 3, 4]; the first is not 1, where SGLang's
# DeepSeek-V2 family (and SpecForge, which hands the ids to SGLang 0.5.14) reads ids differently.
AUX_LAYER_IDS = [2, 3, 5]
LENGTH = 64


def _twin_drafter(name: str, root):
    """(random drafter of the twin's shape, the target's directory, its config). The directory holds the target's
    config.json and the tensors a draft tool takes from its verifier (embedding, final norm, lm_head), random."""
    cfg = twin_config(name)
    emb = cfg.target.embedded
    target = build_model_config(emb, {"vocab_size": emb.vocab_size, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    target_dir = root / "target"
    target.save_pretrained(target_dir)
    generator = torch.Generator().manual_seed(1)
    save_file({"model.embed_tokens.weight": torch.randn(emb.vocab_size, emb.hidden_size, generator=generator),
               "model.norm.weight": torch.rand(emb.hidden_size, generator=generator) + 0.5,
               "lm_head.weight": torch.randn(emb.vocab_size, emb.hidden_size, generator=generator)},
              str(target_dir / "model.safetensors"))  # fmt: skip
    config = DrafterConfig.from_target(target, draft_vocab_size=cfg.data.draft_vocab_size, aux_layer_ids=AUX_LAYER_IDS)
    return random_drafter(config, seed=len(name)), target_dir, target


@pytest.fixture(scope="module")
def twin_exports(tmp_path_factory):
    """name -> (drafter, job for the runner, our logits) for each twin."""
    exports = {}
    for name in TWINS:
        root = tmp_path_factory.mktemp(name)
        drafter, target_dir, target = _twin_drafter(name, root)
        export_drafter(drafter, root / "hf")
        export_speculators(drafter, root / "speculators", str(target_dir), target.to_dict())
        generator = torch.Generator().manual_seed(0)
        cfg = drafter.config
        inputs = {
            "aux": torch.randn(1, LENGTH, cfg.num_aux * cfg.target_hidden_size, generator=generator),
            "input_ids": torch.randint(0, cfg.target_vocab_size, (1, LENGTH), generator=generator),
            "embedding": load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"],
            "positions": torch.arange(LENGTH)[None],
        }
        torch.save(inputs, root / "inputs.pt")
        with torch.no_grad():
            logits, _ = drafter(inputs["embedding"][inputs["input_ids"]], drafter.fuse_aux(inputs["aux"]), inputs["positions"])
        job = {"hf_dir": str(root / "hf"), "speculators_dir": str(root / "speculators"), "target_dir": str(target_dir),
               "inputs": str(root / "inputs.pt")}  # fmt: skip
        exports[name] = (drafter, job, logits)
    return exports


def _run_peer(tool: str, twin_exports, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"{tool}-run")
    jobs = {name: {**job, "output": str(root / f"{name}.pt")} for name, (_, job, _) in twin_exports.items()}
    (root / "jobs.json").write_text(json.dumps(list(jobs.values())))
    python, env = (VLLM_PYTHON, None) if tool == "vllm" else (sys.executable, peer_env(tool))
    done = subprocess.run([python, str(REPO / "tests" / "peer_loader_runner.py"), tool, str(root / "jobs.json")],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert done.returncode == 0, f"{tool}:\n{done.stderr[-4000:]}"
    return {name: torch.load(job["output"], weights_only=False) for name, job in jobs.items()}


@pytest.fixture(scope="module")
def speculators_views(twin_exports, tmp_path_factory):
    return _run_peer("speculators", twin_exports, tmp_path_factory)


@pytest.fixture(scope="module")
def specforge_views(twin_exports, tmp_path_factory):
    return _run_peer("specforge", twin_exports, tmp_path_factory)


@pytest.fixture(scope="module")
def vllm_views(twin_exports, tmp_path_factory):
    return _run_peer("vllm", twin_exports, tmp_path_factory)


def _assert_same_drafter(ours_weights: dict, theirs_weights: dict, ours_logits, theirs_logits, tool: str) -> None:
    missing = sorted(set(ours_weights) - set(theirs_weights))
    assert not missing, f"{tool} has no {missing}"
    for name, tensor in ours_weights.items():
        assert torch.equal(theirs_weights[name], tensor), f"{tool}: {name} differs"
    torch.testing.assert_close(theirs_logits, ours_logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"{tool}: {m}")
    assert torch.equal(theirs_logits.argmax(-1), ours_logits.argmax(-1)), tool


@pytest.mark.parametrize("name", TWINS)
def test_speculators_loads_the_speculators_export(name, twin_exports, speculators_views):
    drafter, _, logits = twin_exports[name]
    view = speculators_views[name]
    ours = {k.replace("midlayer.", "layers.0.", 1): v for k, v in drafter.state_dict().items()}
    _assert_same_drafter(ours, view["weights"], logits, view["logits"], "speculators")
    assert torch.equal(view["draft_tokens"], logits.argmax(-1))  # its own forward, end to end
    # vLLM reads speculators' key as hidden_states[k]: the trained layer outputs + 1, not the default [2, 4, 5].
    vllm_ids = written_aux_ids(drafter.config.target_family, "vllm", VLLM_VERSIONS_CHECKED[-1], AUX_LAYER_IDS)
    assert view["aux_ids"] == vllm_ids == [i + 1 for i in AUX_LAYER_IDS]


@pytest.mark.parametrize("name", TWINS)
def test_speculators_export_is_what_its_converter_writes_given_the_ids(name, twin_exports, speculators_views):
    drafter, _, _ = twin_exports[name]
    view = speculators_views[name]
    ours = {k.replace("midlayer.", "layers.0.", 1): v for k, v in drafter.state_dict().items()}
    assert view["converter_weights"].keys() == ours.keys()
    assert all(torch.equal(view["converter_weights"][k], v) for k, v in ours.items())
    # Versions differ by design; auto_map {"": ...} is an artifact of speculators' save_pretrained that nothing reads.
    ignored = ("speculators_version", "transformers_version", "auto_map")
    converter = {k: v for k, v in view["converter_config_with_ids"].items() if k not in ignored}
    assert {k: v for k, v in view["config"].items() if k not in ignored} == converter
    # The converter alone reads neither aux-id key of the HF export: speculators then falls back to its default.
    assert view["converter_config_without_ids"]["eagle_aux_hidden_state_layer_ids"] is None


@pytest.mark.parametrize("name", TWINS)
def test_specforge_warm_starts_from_the_hf_export(name, twin_exports, specforge_views):
    drafter, _, logits = twin_exports[name]
    view = specforge_views[name]
    _assert_same_drafter(drafter.state_dict(), view["weights"], logits, view["logits"], "specforge")
    # SpecForge hands eagle_config's ids to SGLang (0.5.14, whose rules equal 0.5.23's): SGLang's ids, not vLLM's.
    sglang_ids = written_aux_ids(drafter.config.target_family, "sglang", SGLANG_EXPORT_VERSION, AUX_LAYER_IDS)
    assert view["aux_ids"] == sglang_ids


@pytest.mark.parametrize("name", TWINS)
def test_vllm_reads_both_exports_as_the_same_drafter(name, twin_exports, vllm_views):
    drafter, _, _ = twin_exports[name]
    hf, speculators = vllm_views[name]["hf_dir"], vllm_views[name]["speculators_dir"]
    assert speculators["architectures"] == ["Eagle3LlamaForCausalLM"]
    # vLLM defaults an absent norm_before_residual to true in the speculators format only: the export writes false.
    assert speculators["norm_before_residual"] is False
    vllm_ids = written_aux_ids(drafter.config.target_family, "vllm", VLLM_VERSIONS_CHECKED[-1], AUX_LAYER_IDS)
    assert hf["eagle_aux_hidden_state_layer_ids"] == speculators["eagle_aux_hidden_state_layer_ids"] == vllm_ids
    assert {k: v for k, v in hf.items() if k != "architectures"} == {k: v for k, v in speculators.items() if k != "architectures"}
