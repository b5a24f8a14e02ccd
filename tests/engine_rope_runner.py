"""Rotate q and k with a serving engine's own rotary-embedding code, for tests/integration/test_drafter_rope.py.

Run by the engine's interpreter: `python engine_rope_runner.py ENGINE SOURCE JOBS`, JOBS a JSON list of
{export_dir, inputs, output}.
- ENGINE vllm: SOURCE is ignored; vLLM is imported as installed (.venv-vllm). Its Llama attention (also the EAGLE-3
  draft's) calls `get_rope(head_dim, max_position=max_position_embeddings, rope_parameters=config.rope_parameters,
  is_neox_style=True)` on the config vLLM loads from the export directory.
- ENGINE sglang: SOURCE is an unpacked SGLang wheel. SGLang cannot be imported without a GPU stack (triton,
  sgl_kernel), so the function and class definitions of its rotary-embedding module(s) are executed unmodified in
  one namespace where the only substitute is the base class `CustomOp` (torch.nn.Module; only `forward_native`,
  SGLang's reference path, is called). The draft's Llama attention calls `get_rope(head_dim, rotary_dim=head_dim,
  max_position=max_position_embeddings, base=rope_theta, rope_scaling=..., is_neox_style=True)`, where rope_scaling
  is `config.rope_scaling` (transformers 4.x, and 0.5.6 always) or transformers 5's `config.rope_parameters`
  (0.5.12+ prefer it when present); ENGINE sglang-transformers5 runs the latter.
- ENGINE transformers: SOURCE is ignored; the interpreter's transformers builds `LlamaRotaryEmbedding` from
  `AutoConfig.from_pretrained(export_dir)` and applies it with `apply_rotary_pos_emb`, as its LlamaAttention does.
- ENGINE speculators: run with the speculators overlay on PYTHONPATH (scripts/setup_peer_envs.sh); SOURCE is
  ignored, the speculators-format export is export_dir/speculators. `Eagle3DraftModel(config)` builds its own rotary embedding (from the draft layer's
  config, the way speculators does) and its decoder layer (transformers' Llama attention) applies it.
- ENGINE specforge: run with the SpecForge overlay on PYTHONPATH; SpecForge's draft config loader
  (`AutoDraftModelConfig.from_file`) reads config.json and its `LlamaAttention._init_rope` picks the rotary class;
  its cos/sin cache is applied with its own `apply_rotary_pos_emb`.
inputs holds positions [T], q [T, heads*D], k [T, kv_heads*D]; output gets the rotated q and k and the rope class.
"""

from __future__ import annotations

import ast
import json
import math
import sys
import types
from pathlib import Path

import torch


def _sglang_namespace(source_root: Path) -> dict:
    layers = source_root / "sglang" / "srt" / "layers"
    single = layers / "rotary_embedding.py"
    files = [single] if single.is_file() else sorted((layers / "rotary_embedding").glob("*.py"))
    # The server context the rotary classes consult: a CPU with AMX (SGLang's intel_amx CPU path), no RL on-policy target,
    # fp32 caches. Op base classes become nn.Module: only forward_native, SGLang's reference path, is called.
    server_args = types.SimpleNamespace(rl_on_policy_target=None)
    namespace = {"__name__": "sglang_rotary", "torch": torch, "nn": torch.nn, "math": math,
                 "CustomOp": torch.nn.Module, "BaseFusedOp": torch.nn.Module, "MultiPlatformOp": torch.nn.Module,
                 "get_global_server_args": lambda: server_args, "publish_role": lambda: None,
                 "envs": types.SimpleNamespace(SGLANG_ROPE_CACHE_FP32=types.SimpleNamespace(get=lambda: True)),
                 "current_platform": types.SimpleNamespace(is_out_of_tree=lambda: False),
                 "_is_hip": False, "_use_aiter": False, "_is_cuda": False, "_is_npu": False, "_is_cpu": True,
                 "_is_cpu_amx_available": True, "_is_xpu": False, "_is_musa": False, "_is_mps": False}  # fmt: skip
    exec("from typing import *\nimport functools, itertools, logging\nlogger = logging.getLogger('rope')", namespace)
    pending = []
    for path in files:
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                pending.append(ast.Module(body=[node], type_ignores=[]))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict) and not node.value.keys:
                pending.append(ast.Module(body=[node], type_ignores=[]))  # module-level caches such as _ROPE_DICT
    # Classes subclass classes of other files: define in passes until nothing new resolves. What never resolves
    # needs a GPU package (triton kernels, mrope's triton path) and is not on the paths the drafter's config takes.
    while pending:
        left = []
        for module in pending:
            try:
                exec(compile(module, "sglang_rotary", "exec"), namespace)
            except NameError:
                left.append(module)
        if len(left) == len(pending):
            break
        pending = left
    if "get_rope" not in namespace:
        raise RuntimeError(f"get_rope could not be defined from {files}")
    return namespace


def _heads(x, head_dim: int):
    """[T, heads*D] -> [1, heads, T, D], the layout the HF-style attention code rotates."""
    return x.view(x.shape[0], -1, head_dim).transpose(0, 1)[None]


def _flat(x):
    return x[0].transpose(0, 1).reshape(x.shape[2], -1)


def _rotate_transformers(export_dir: str, positions, q, k):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = AutoConfig.from_pretrained(export_dir)
    rope = LlamaRotaryEmbedding(config)
    q4, k4 = _heads(q, config.head_dim), _heads(k, config.head_dim)
    cos, sin = rope(q4, positions[None])
    q_out, k_out = apply_rotary_pos_emb(q4, k4, cos, sin)
    return _flat(q_out), _flat(k_out), f"LlamaRotaryEmbedding:{rope.rope_type}"


def _rotate_speculators(speculators_dir: str, positions, q, k):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = Eagle3DraftModel(Eagle3SpeculatorConfig.from_pretrained(speculators_dir))
    head_dim = model.config.transformer_layer_config.head_dim
    q4, k4 = _heads(q, head_dim), _heads(k, head_dim)
    cos, sin = model.rotary_emb(q4, positions[None])
    q_out, k_out = apply_rotary_pos_emb(q4, k4, cos, sin)
    return _flat(q_out), _flat(k_out), f"LlamaRotaryEmbedding:{model.rotary_emb.rope_type}"


def _rotate_specforge(export_dir: str, positions, q, k):
    from specforge.modeling.auto import AutoDraftModelConfig
    from specforge.modeling.draft.llama3_eagle import LlamaAttention, apply_rotary_pos_emb

    attention = LlamaAttention(AutoDraftModelConfig.from_file(str(Path(export_dir) / "config.json")))
    rope = attention.rotary_emb
    q4, k4 = _heads(q, attention.head_dim), _heads(k, attention.head_dim)
    q_out, k_out = apply_rotary_pos_emb(q4, k4, rope.cos_cached, rope.sin_cached, positions[None])
    return _flat(q_out), _flat(k_out), type(rope).__name__


def _rotate(engine: str, source: str, export_dir: str, positions, q, k):
    if engine == "transformers":
        return _rotate_transformers(export_dir, positions, q, k)
    if engine == "speculators":
        return _rotate_speculators(str(Path(export_dir) / "speculators"), positions, q, k)
    if engine == "specforge":
        return _rotate_specforge(export_dir, positions, q, k)
    if engine == "vllm":
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope
        from vllm.transformers_utils.config import get_config

        config = get_config(export_dir, trust_remote_code=False)
        with set_current_vllm_config(VllmConfig()):  # as vLLM's own op tests do; CustomOps read it when built
            rope = get_rope(config.head_dim, max_position=config.max_position_embeddings,
                            rope_parameters=getattr(config, "rope_parameters", None), is_neox_style=True,
                            dtype=torch.float32)  # fmt: skip
            return (*rope.forward_native(positions, q.clone(), k.clone()), type(rope).__name__)
    # "sglang": the config as transformers 4.x exposes it (config.json's keys as attributes);
    # "sglang-transformers5": transformers 5's rope_parameters, which 0.5.12+ prefer when present.
    namespace = _sglang_namespace(Path(source))
    config = json.loads((Path(export_dir) / "config.json").read_text())
    if engine == "sglang-transformers5":
        from transformers import AutoConfig

        rope_scaling = AutoConfig.from_pretrained(export_dir).rope_parameters
        theta = rope_scaling.get("rope_theta", 10000)
    else:
        rope_scaling, theta = config.get("rope_scaling"), config.get("rope_theta", 10000)
    head_dim, max_position = config["head_dim"], config["max_position_embeddings"]
    rope = namespace["get_rope"](head_dim, rotary_dim=head_dim, max_position=max_position, base=theta,
                                 rope_scaling=rope_scaling, is_neox_style=True, dtype=torch.float32)  # fmt: skip
    return (*rope.forward_native(positions, q.clone(), k.clone()), type(rope).__name__)


def main() -> None:
    engine, source, jobs_path = sys.argv[1:4]
    for job in json.loads(Path(jobs_path).read_text()):
        inputs = torch.load(job["inputs"])
        q_out, k_out, rope_class = _rotate(engine, source, job["export_dir"], inputs["positions"], inputs["q"], inputs["k"])
        torch.save({"q": q_out, "k": k_out, "class": rope_class}, job["output"])


if __name__ == "__main__":
    main()
