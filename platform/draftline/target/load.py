"""Loading a target (embedded or any HF causal LM), its fingerprint, and the EAGLE-3 aux layer ids."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from draftline.config import ConfigError, DraftlineConfig
from draftline.target.bootstrap import bootstrap_target
from draftline.target.aux_layers import AuxLayerIdError, aux_layer_ids, default_aux_layer_ids  # noqa: F401 (re-export)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Weight files above this are fingerprinted by name, size and their first/last MiB instead of full content.
_FULL_HASH_LIMIT_BYTES = 2 << 30


def engine_version(cfg: DraftlineConfig) -> Optional[str]:
    """The configured version of the serving engine (None for the reference engine)."""
    backend = cfg.engine.backend
    return getattr(cfg.engine, backend).version if backend != "reference" else None


def resolve_aux_layer_ids(cfg: DraftlineConfig, num_layers: int, family: str) -> list[int]:
    """Capture (layer-output) ids for extraction: extract.aux_layer_ids, else the configured engine's default."""
    try:
        ids = aux_layer_ids(family, cfg.engine.backend, engine_version(cfg), num_layers, cfg.extract.aux_layer_ids)
    except AuxLayerIdError as err:
        raise ConfigError(f"{err}; fix extract.aux_layer_ids (or leave it empty for the engine's default)") from None
    return list(ids.capture)


def target_fingerprint(target_dir: str | Path) -> str:
    """Identity of a target: its config.json plus a hash of every weight file."""
    target_dir = Path(target_dir)
    digest = hashlib.sha256()
    digest.update((target_dir / "config.json").read_bytes())
    weight_files = sorted(target_dir.glob("*.safetensors")) or sorted(target_dir.glob("*.bin"))
    for path in weight_files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as handle:
            if size <= _FULL_HASH_LIMIT_BYTES:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
            else:
                digest.update(handle.read(1 << 20))
                handle.seek(size - (1 << 20))
                digest.update(handle.read())
    return digest.hexdigest()[:16]


@dataclass
class LoadedTarget:
    model: Any
    tokenizer: Any
    path: Path
    fingerprint: str
    num_layers: int
    hidden_size: int
    vocab_size: int


def resolve_target_dir(cfg: DraftlineConfig) -> Path:
    if cfg.target.kind in ("embedded", "gguf"):
        return bootstrap_target(cfg)
    path = Path(cfg.target.path).expanduser()
    if not (path / "config.json").exists():
        raise ConfigError(
            f"target.path {cfg.target.path!r}: no config.json there. Point it at a local HF model directory "
            "(download it beforehand; draftline never fetches weights at run time)"
        )
    return path


def check_declared_shape(cfg: DraftlineConfig, hf_config: Any) -> None:
    declared = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "vocab_size": "vocab_size"}
    for field, hf_name in declared.items():
        want = getattr(cfg.target, field)
        have = getattr(hf_config, hf_name, None)
        if want is not None and have is not None and want != have:
            raise ConfigError(f"target.{field} is {want} in the config but the model at {cfg.target.path} has {hf_name}={have}")


def load_target(cfg: DraftlineConfig, device: str = "cpu", target_dir: str | Path | None = None) -> LoadedTarget:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(target_dir) if target_dir is not None else resolve_target_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.target.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=_DTYPES[cfg.target.dtype], trust_remote_code=cfg.target.trust_remote_code
    ).to(device)
    model.eval()
    check_declared_shape(cfg, model.config)
    return LoadedTarget(
        model=model,
        tokenizer=tokenizer,
        path=path,
        fingerprint=target_fingerprint(path),
        num_layers=model.config.num_hidden_layers,
        hidden_size=model.config.hidden_size,
        vocab_size=model.config.vocab_size,
    )


def read_target_config(target_dir: str | Path) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())
