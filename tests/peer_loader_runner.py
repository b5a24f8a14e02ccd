"""Load draftline exports with a peer tool's own code, for tests/integration/test_peer_loaders.py.

Run by draftline's interpreter with the tool's overlay first on PYTHONPATH (engine_sources.peer_env), or by
.venv-vllm's interpreter for vLLM:
`python peer_loader_runner.py TOOL JOBS`, JOBS a JSON list of {hf_dir, speculators_dir, target_dir, inputs, output}.
inputs (torch.save): aux [1, T, n_aux*H] (the fc input), input_ids [1, T], embedding [V, H] (the target's, in
target_dir/model.safetensors, which the drafter shares), positions [1, T]. output (torch.save): the tool's view of the export: its weights under its own
names, its draft logits [1, T, Vd] for those inputs, the aux layer ids it resolves, and what else the tool writes.
- TOOL speculators (0.9.0): `Eagle3DraftModel.from_pretrained(speculators_dir)` (which resolves the aux ids against
  the verifier's config); logits from its modules in the order its forward applies them (fc, rotary, layers[0],
  norm, lm_head), and `forward(ttt_steps=1)`'s own draft tokens; its `Eagle3Converter` run on hf_dir, with the ids
  of our speculators config and without ids (what a user of the converter gets): the configs as speculators loads them.
- TOOL specforge (0.2.0): the draft config through `AutoDraftModelConfig.from_file`, the model built by
  `AutoDraftModel.from_config` and filled by `warm_start_draft_model` (its warm-start path); logits through the
  EAGLE-3 trainer's step (project_hidden_states, backbone with its sdpa cache, compute_logits); the capture layers
  from `resolve_eagle_capture_layers` (which it hands to SGLang's set_eagle3_layers_to_capture).
- TOOL vllm (0.32.0): both exports' config.json as vLLM's `get_config` reads them (the speculators one through its
  speculators config adapter), the fields its EAGLE-3 draft model reads, with its defaults.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch


def _plain(config: dict) -> dict:
    """A loaded config as JSON data (dtypes and nested configs as their text)."""
    return json.loads(json.dumps(config, default=str))


def _speculators(job: dict, inputs: dict) -> dict:
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    model = Eagle3DraftModel.from_pretrained(job["speculators_dir"]).eval()
    with torch.no_grad():
        # from_pretrained takes the verifier's embedding only where its own is NaN, and the uninitialized tensor
        # need not be: set it, as vLLM shares the target's.
        model.embed_tokens.weight.copy_(inputs["embedding"])
        positions = inputs["positions"]
        hidden = model.fc(inputs["aux"])
        layer_in = torch.cat([inputs["embedding"][inputs["input_ids"]], hidden], dim=-1)
        position_embeddings = model.rotary_emb(layer_in, positions)
        length = positions.shape[1]
        mask = model._build_attn_mask(torch.zeros(length, dtype=torch.long), length, positions.device)  # its forward's mask
        out = model.layers[0](layer_in, attention_mask=mask, position_ids=positions, position_embeddings=position_embeddings)
        logits = model.lm_head(model.norm(out))
        (draft_tokens,) = model(hidden_states=inputs["aux"], input_ids=inputs["input_ids"],
                                document_ids=torch.zeros_like(inputs["input_ids"]), position_ids=positions, ttt_steps=1)  # fmt: skip
    converted = {}
    with tempfile.TemporaryDirectory() as tmp:
        ours = json.loads((Path(job["speculators_dir"]) / "config.json").read_text())
        for name, ids in (("with_ids", ours.get("eagle_aux_hidden_state_layer_ids")), ("without_ids", None)):
            out_dir = Path(tmp) / name
            Eagle3Converter().convert(job["hf_dir"], out_dir, base_model=job["target_dir"], eagle_aux_hidden_state_layer_ids=ids)
            converted[name] = _plain(Eagle3SpeculatorConfig.from_pretrained(out_dir).to_dict())
            if name == "with_ids":
                from safetensors.torch import load_file

                converted["weights"] = load_file(str(out_dir / "model.safetensors"))
    return {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "logits": logits,
        "draft_tokens": draft_tokens,
        "aux_ids": model.config.eagle_aux_hidden_state_layer_ids,
        "config": _plain(Eagle3SpeculatorConfig.from_pretrained(job["speculators_dir"]).to_dict()),
        "converter_config_with_ids": converted["with_ids"],
        "converter_config_without_ids": converted["without_ids"],
        "converter_weights": converted["weights"],
    }


def _specforge(job: dict, inputs: dict) -> dict:
    from transformers import AutoConfig

    from specforge.algorithms.model_providers import resolve_eagle_capture_layers
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from specforge.training.model_loading import warm_start_draft_model

    config_path = str(Path(job["hf_dir"]) / "config.json")
    draft_config = AutoDraftModelConfig.from_file(config_path)
    model = AutoDraftModel.from_config(draft_config)
    warm_start_draft_model(model, job["hf_dir"], draft_config=draft_config, strategy="eagle3", allow_missing_embedding=True)
    model.eval()
    with torch.no_grad():
        batch, length = inputs["input_ids"].shape
        mask = model.prepare_decoder_attention_mask(
            attention_mask=torch.ones(batch, length, dtype=torch.bool), hidden_states=inputs["aux"],
            batch_size=batch, seq_length=length, past_key_values_length=0,
        )  # fmt: skip
        hidden = model.project_hidden_states(inputs["aux"])
        out = model.backbone(input_embeds=inputs["embedding"][inputs["input_ids"]], hidden_states=hidden, cache_hidden=[[], []],
                             attention_mask=mask, position_ids=inputs["positions"])  # fmt: skip
        logits = model.compute_logits(out)
    run_config = SimpleNamespace(model=SimpleNamespace(aux_hidden_state_layer_ids=None))
    target_config = AutoConfig.from_pretrained(job["target_dir"])
    layers = resolve_eagle_capture_layers(run_config, json.loads(Path(config_path).read_text()), target_config)
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "logits": logits, "aux_ids": layers}


# What vLLM's EAGLE-3 draft model (model_executor/models/llama_eagle3.py) reads from its config, with its defaults.
_VLLM_FIELDS = {"architectures": None, "hidden_size": None, "num_attention_heads": None, "num_key_value_heads": None,
                "head_dim": None, "intermediate_size": None, "rms_norm_eps": None, "max_position_embeddings": None,
                "vocab_size": None, "draft_vocab_size": None, "target_hidden_size": None, "rope_parameters": None,
                "eagle_aux_hidden_state_layer_ids": None, "norm_before_residual": False, "norm_before_fc": False,
                "fc_norm": False, "norm_output": False}  # fmt: skip


def _vllm(job: dict, inputs: dict) -> dict:
    from vllm.transformers_utils.config import get_config

    views = {}
    for export in ("hf_dir", "speculators_dir"):
        config = get_config(job[export], trust_remote_code=False)
        views[export] = {name: getattr(config, name, default) for name, default in _VLLM_FIELDS.items()}
    return views


TOOLS = {"speculators": _speculators, "specforge": _specforge, "vllm": _vllm}


def main() -> None:
    tool, jobs_path = sys.argv[1:3]
    torch.manual_seed(0)
    for job in json.loads(Path(jobs_path).read_text()):
        inputs = torch.load(job["inputs"])
        torch.save(TOOLS[tool](job, inputs), job["output"])


if __name__ == "__main__":
    main()
