"""The one mapping of aux layer ids: capture ids (layer outputs) vs what each engine reads, pinned to the engines' code."""

from __future__ import annotations

import ast
import json
from types import SimpleNamespace
from typing import List, Optional

import pytest

from draftline.drafter.export import SGLANG_EXPORT_VERSION, SGLANG_VERSIONS_CHECKED, SPECFORGE_SGLANG_VERSION
from draftline.target.aux_layers import (
    AuxIdRule,
    AuxLayerIdError,
    aux_layer_ids,
    capture_ids_from_written,
    default_aux_layer_ids,
    family_of,
    register_rule,
    rule_for,
    _RULES,
)
from engine_sources import REPO, method_from_source, read_wheel_file, sglang_wheel


@pytest.mark.parametrize("engine", ["reference", "sglang", "vllm"])
def test_llama_default_capture_is_the_same_for_every_engine(engine):
    # Both engines capture the inputs of layers [2, n//2, n-3] by default = outputs of [1, n//2-1, n-4].
    assert list(aux_layer_ids("llama", engine, None, 32).capture) == [1, 15, 28]
    assert default_aux_layer_ids(8, engine=engine) == [1, 3, 4]


def test_written_ids_per_engine():
    assert aux_layer_ids("llama", "sglang", "0.5.23", 8, [1, 3, 4]).written == (1, 3, 4)  # SGLang adds 1 itself
    assert aux_layer_ids("llama", "vllm", "0.32.0", 8, [1, 3, 4]).written == (2, 4, 5)  # vLLM: hidden_states[k]
    assert capture_ids_from_written("llama", "vllm", "0.32.0", 8, [2, 4, 5], where="x") == [1, 3, 4]


def test_unknown_family_uses_the_llama_rule():
    assert rule_for("mistral", "vllm", "0.32.0") is rule_for("llama", "vllm", "0.32.0")
    assert family_of({"model_type": "qwen3"}) == "qwen3" and family_of({}) == "llama"


def test_a_family_rule_takes_precedence_only_where_it_applies():
    rule = AuxIdRule("sglang", "test-family", 0, lambda n: [3, n - 2], "test", versions=("0.5.23",))
    register_rule(rule)
    try:
        assert rule_for("test-family", "sglang", "0.5.23") is rule
        assert rule_for("test-family", "sglang", "0.5.12") is rule_for("llama", "sglang", "0.5.12")
        assert list(aux_layer_ids("test-family", "sglang", "0.5.23", 8).capture) == [2, 5]
    finally:
        _RULES.remove(rule)


@pytest.mark.parametrize(
    "ids, message",
    [([], "no aux layer ids"), ([1, 7], "outside 0..6"), ([3, 1, 4], "ascending"), ([1, 1, 4], "ascending"),
     ([-1, 2], "outside")],  # fmt: skip
)
def test_ids_an_engine_would_capture_differently_are_refused(ids, message):
    with pytest.raises(AuxLayerIdError, match=message) as err:
        aux_layer_ids("llama", "vllm", "0.32.0", 8, ids, where="extract.aux_layer_ids")
    assert "extract.aux_layer_ids" in str(err.value)


def test_written_ids_outside_the_target_name_the_file():
    with pytest.raises(AuxLayerIdError, match=r"draft/config.json .* means layer-output ids \[1, 3, 7\]"):
        capture_ids_from_written("llama", "vllm", "0.32.0", 8, [2, 4, 8], where="draft/config.json ids")


class _Layers:
    pass


@pytest.mark.parametrize("version", SGLANG_VERSIONS_CHECKED)
def test_sglang_llama_capture_is_what_the_rule_says(version):
    """Runs SGLang's own LlamaForCausalLM.set_eagle3_layers_to_capture (from the released wheel) on a stand-in model."""
    wheel = sglang_wheel(version)
    source = read_wheel_file(wheel, "sglang/srt/models/llama.py")
    set_layers = method_from_source(source, "LlamaForCausalLM", "set_eagle3_layers_to_capture", {"Optional": Optional, "List": List})
    rule = rule_for("llama", "sglang", version)
    for num_layers, capture in ((8, [1, 3, 4]), (8, [0, 2, 6]), (32, [1, 15, 28])):
        fake = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), model=_Layers(),
                               config=SimpleNamespace(num_hidden_layers=num_layers))  # fmt: skip
        set_layers(fake, rule.to_written(capture))
        # SGLang appends the residual entering each listed layer: the output of the layer before it.
        assert fake.model.layers_to_capture == [i + 1 for i in capture]
        set_layers(fake, None)
        assert [layer - 1 for layer in fake.model.layers_to_capture] == rule.default_capture_ids(num_layers)
    # The draft's ids are read from eagle_config only (a top-level key is vLLM's, see drafter/export.py).
    runner_files = {
        "0.5.6": "sglang/srt/model_executor/model_runner.py",
        "0.5.12": "sglang/srt/model_executor/model_runner.py",
        "0.5.23": "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py",
    }
    compact_runner = "".join(read_wheel_file(wheel, runner_files[version]).split())
    assert 'eagle_config["eagle_aux_hidden_state_layer_ids"]' in compact_runner
    assert 'hf_config,"eagle_aux_hidden_state_layer_ids"' not in compact_runner


class _MoeLayers:
    """Stand-in for Qwen2MoeModel: records the input layers SGLang's qwen3_moe.py hands it."""

    def set_eagle3_layers_to_capture(self, layers_to_capture):
        self.layers_to_capture = layers_to_capture


# (model file, class, target family = HF model_type) for every shape-twin family that is not Llama.
SGLANG_FAMILY_FILES = [
    ("qwen3.py", "Qwen3ForCausalLM", "qwen3", _Layers),
    ("qwen3_moe.py", "Qwen3MoeForCausalLM", "qwen3_moe", _MoeLayers),
    ("deepseek_v2.py", "DeepseekV2ForCausalLM", "deepseek_v3", _Layers),
]


@pytest.mark.parametrize("version", SGLANG_VERSIONS_CHECKED)
@pytest.mark.parametrize("model_file, class_name, family, layers", SGLANG_FAMILY_FILES, ids=lambda v: str(v))
def test_sglang_family_capture_is_what_the_rule_says(version, model_file, class_name, family, layers):
    """SGLang's own set_eagle3_layers_to_capture of each family's model file, run on a stand-in model: what it captures
    for the ids our rule writes is what the drafter was trained on (DeepSeek in 0.5.23 shifts only a list starting at 1)."""
    _check_sglang_capture(version, model_file, class_name, family, layers)


@pytest.mark.slow
@pytest.mark.parametrize("model_file, class_name, family, layers", [("llama.py", "LlamaForCausalLM", "llama", _Layers),
                                                                    *SGLANG_FAMILY_FILES], ids=lambda v: str(v))  # fmt: skip
def test_specforge_sglang_capture_is_what_the_rule_says(model_file, class_name, family, layers):
    """SpecForge hands eagle_config's ids to the SGLang it pins (tests/integration/test_peer_loaders.py): that release's
    own capture code reads the ids an export writes (for SGLANG_EXPORT_VERSION) as the layers the drafter trained on."""
    _check_sglang_capture(SPECFORGE_SGLANG_VERSION, model_file, class_name, family, layers)
    assert rule_for(family, "sglang", SPECFORGE_SGLANG_VERSION) is rule_for(family, "sglang", SGLANG_EXPORT_VERSION)


def _check_sglang_capture(version, model_file, class_name, family, layers):
    source = read_wheel_file(sglang_wheel(version), f"sglang/srt/models/{model_file}")
    set_layers = method_from_source(source, class_name, "set_eagle3_layers_to_capture", {"Optional": Optional, "List": List})
    rule = rule_for(family, "sglang", version)
    for num_layers, capture in ((8, [1, 3, 4]), (8, [2, 3, 6]), (61, [1, 29, 57])):
        fake = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), model=layers(),
                               config=SimpleNamespace(num_hidden_layers=num_layers))  # fmt: skip
        set_layers(fake, rule.to_written(capture))
        assert list(fake.model.layers_to_capture) == [i + 1 for i in capture], (rule.source, capture)
        assert rule.to_capture(rule.to_written(capture)) == capture
        set_layers(fake, None)
        assert [layer - 1 for layer in fake.model.layers_to_capture] == rule.default_capture_ids(num_layers)


def test_deepseek_on_sglang_0_5_23_refuses_a_first_id_it_cannot_express():
    with pytest.raises(AuxLayerIdError, match=r"extract.aux_layer_ids: .*deepseek_v2.py 0.5.23 cannot capture the output of layer 0"):
        aux_layer_ids("deepseek_v3", "sglang", "0.5.23", 8, [0, 3, 4], where="extract.aux_layer_ids")
    assert aux_layer_ids("deepseek_v3", "sglang", "0.5.12", 8, [0, 3, 4]).written == (0, 3, 4)
    assert aux_layer_ids("kimi_k2", "sglang", "0.5.23", 61, [1, 29, 57]).written == (1, 29, 57)
    assert aux_layer_ids("deepseek_v3", "sglang", "0.5.23", 8, [2, 3, 4]).written == (3, 4, 5)


# Runs in .venv-vllm: vLLM 0.32's own decoder forward (the capture loop) on stand-in layers whose output is the
# layer's number, and its own default-layer method; prints per family what it captures for given written ids.
VLLM_CAPTURE_PROBE = """
import importlib, json, sys
from functools import partial
from types import SimpleNamespace
import torch
from vllm.model_executor.models.interfaces import EagleModelMixin, supports_eagle3

def captured(model_cls, module, num_layers, written):
    module.get_pp_group = lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True)
    def layer(k):  # the output of layer k is k + 1; the embedding is 0
        return lambda positions, hidden, residual, **kw: (torch.full((1, 1), float(k + 1)), torch.zeros(1, 1))
    fake = SimpleNamespace(start_layer=0, end_layer=num_layers, layers=[layer(k) for k in range(num_layers)],
                           embed_input_ids=lambda ids: torch.zeros(1, 1), norm=lambda h, r: (h, None),
                           aux_hidden_state_layers=tuple(written), collect_remote_aux_hidden_states=lambda t: [])
    fake._maybe_add_hidden_state = partial(EagleModelMixin._maybe_add_hidden_state, fake)
    ids = torch.zeros(1, dtype=torch.long)
    _, aux = model_cls.forward(fake, ids, ids, None)
    return [int(t.item()) - 1 for t in aux]

report = []
for family, module_name, model_name, lm_name, num_layers, written in json.loads(sys.argv[1]):
    module = importlib.import_module(f"vllm.model_executor.models.{module_name}")
    lm_cls = getattr(module, lm_name)
    stand_in = SimpleNamespace(model=SimpleNamespace(layers=[None] * num_layers))
    model_cls = getattr(module, model_name)
    report.append({
        "supports_eagle3": supports_eagle3(lm_cls),
        "default_input_layers": list(lm_cls.get_eagle3_default_aux_hidden_state_layers(stand_in)),
        "captured": captured(model_cls, sys.modules[model_cls.forward.__module__], num_layers, written),
    })
print("REPORT", json.dumps(report))
"""


def test_vllm_capture_per_family_is_what_the_rule_says():
    """vLLM 0.32 (.venv-vllm): Llama, Qwen3 and gpt-oss support EAGLE-3, their own forward captures, for the ids our rule writes,
    exactly the layer outputs the drafter was trained on, and their default layers are the rule's."""
    import json
    import subprocess

    from draftline.config import DraftlineConfig
    from draftline.engines.vllm.engine import vllm_python

    version = DraftlineConfig().engine.vllm.version
    cases = []
    for family, module_name, model_name, lm_name in (("llama", "llama", "LlamaModel", "LlamaForCausalLM"),
                                                     ("qwen3", "qwen3", "Qwen3Model", "Qwen3ForCausalLM"),
                                                     ("gpt_oss", "gpt_oss", "GptOssModel", "GptOssForCausalLM")):  # fmt: skip
        for num_layers, capture in ((8, [1, 3, 4]), (8, [0, 2, 6]), (36, [1, 17, 32])):
            written = aux_layer_ids(family, "vllm", version, num_layers, capture).written
            cases.append((family, module_name, model_name, lm_name, num_layers, written, capture))
    probe = [case[:6] for case in cases]
    done = subprocess.run([str(vllm_python(DraftlineConfig())), "-c", VLLM_CAPTURE_PROBE, json.dumps(probe)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT", 1)[1])
    for (family, _, _, _, num_layers, written, capture), seen in zip(cases, report):
        rule = rule_for(family, "vllm", version)
        assert seen["supports_eagle3"], family
        assert seen["captured"] == capture, (family, num_layers, written, rule.source)
        assert seen["default_input_layers"] == rule.default_input_layers(num_layers), (family, rule.source)


VLLM_EAGLE3_SUPPORT_PROBE = """
import importlib, json, sys
from vllm.model_executor.models.interfaces import supports_eagle3
print("REPORT", json.dumps({f"{m}.{c}": supports_eagle3(getattr(importlib.import_module(f"vllm.model_executor.models.{m}"), c))
                            for m, c in json.loads(sys.argv[1])}))
"""


def test_vllm_lacks_eagle3_for_exactly_the_architectures_the_preflight_refuses():
    """vLLM 0.32's own model classes: Gemma3ForCausalLM has no EAGLE-3 interface (vLLM raises "Model does not support
    EAGLE3 interface but aux_hidden_state_outputs was requested" once the target has loaded), gpt-oss has; draftline's
    vLLM preflight refuses the first up front."""
    import json
    import subprocess

    from draftline.config import DraftlineConfig
    from draftline.engines.vllm.engine import vllm_python
    from draftline.engines.vllm.preflight import NO_EAGLE3_ARCHITECTURES

    classes = [("gemma3", "Gemma3ForCausalLM"), ("gpt_oss", "GptOssForCausalLM"), ("llama", "LlamaForCausalLM")]
    done = subprocess.run([str(vllm_python(DraftlineConfig())), "-c", VLLM_EAGLE3_SUPPORT_PROBE, json.dumps(classes)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    supported = json.loads(done.stdout.split("REPORT", 1)[1])
    assert {c for (m, c) in classes if not supported[f"{m}.{c}"]} == set(NO_EAGLE3_ARCHITECTURES)


def _gemma3_capture_in(source: str) -> str:
    """What a release's gemma3_causal.py captures, read from its code: "none" (no EAGLE-3), "stream" (the layers add
    their residual, so `hidden_states` is the residual stream), "mlp-output" (the layers take the residual apart and
    the model still appends `hidden_states` alone)."""
    if "def set_eagle3_layers_to_capture" not in source:
        return "none"
    tree = ast.parse(source)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    forward = next(f for f in classes["Gemma3DecoderLayer"].body if isinstance(f, ast.FunctionDef) and f.name == "forward")
    model = next(f for f in classes["Gemma3TextModel"].body if isinstance(f, ast.FunctionDef) and f.name == "forward")
    appended = {ast.unparse(call.args[0]) for call in ast.walk(model)
                if isinstance(call, ast.Call) and ast.unparse(call.func) == "aux_hidden_states.append"}  # fmt: skip
    assert appended == {"hidden_states"}, appended  # anything else: read this release again
    return "mlp-output" if "residual" in [arg.arg for arg in forward.args.args] else "stream"


def test_sglang_preflight_knows_what_each_release_captures_for_gemma3(tmp_path):
    """Every SGLang release `make sglang` keeps (.sglang/wheels, 0.5.6 to 0.5.23): the preflight's TARGET_CAPTURE
    table against the release's own gemma3_causal.py, and its finding on a Gemma 3 target with a draftline drafter."""
    from draftline.engines.sglang.preflight import preflight
    from draftline.engines.sglang.rules import target_capture

    wheels = sorted((REPO / ".sglang" / "wheels").glob("sglang-*.whl"))
    assert len(wheels) >= 20, f"run `make sglang`: {len(wheels)} wheels in .sglang/wheels"
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"]}))
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    seen = {}
    for wheel in wheels:
        version = wheel.name.split("-")[1]
        captured = _gemma3_capture_in(read_wheel_file(wheel, "sglang/srt/models/gemma3_causal.py"))
        table = target_capture("Gemma3ForCausalLM", version)
        assert table == captured, f"SGLang {version}'s gemma3_causal.py captures {captured}, the table says {table}"
        argv = ["python", "-m", "sglang.launch_server", "--model-path", str(tmp_path / "target"), "--speculative-algorithm",
                "EAGLE3", "--speculative-draft-model-path", str(tmp_path / "draft"), "--speculative-num-steps", "3",
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
        findings = [f for f in preflight(argv, version) if f.rule == "target-capture"]
        expected = {"none": ["error"], "stream": [], "mlp-output": ["warning"]}[captured]
        assert [f.level for f in findings] == expected, (version, findings)
        seen[captured] = seen.get(captured, 0) + 1
    assert set(seen) == {"none", "stream", "mlp-output"}, seen
