"""Engine backends and the factory the bench, the gate and serving use.

`ENGINE_BACKENDS` maps `engine.backend` to the class implementing the `Engine` protocol (engines/base.py),
imported lazily so the reference engine does not need SGLang's dependencies and the other way round.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Optional

from draftline.config import ConfigError, DraftlineConfig, SpeculativeConfig
from draftline.engines.base import Engine

ENGINE_BACKENDS: dict[str, str] = {
    "reference": "draftline.engines.reference.engine:ReferenceEngine",
    "sglang": "draftline.engines.sglang.engine:SGLangEngine",
    "vllm": "draftline.engines.vllm.engine:VLLMEngine",
}


def engine_class(backend: str):
    if backend not in ENGINE_BACKENDS:
        raise ConfigError(f"engine.backend {backend!r}: known backends are {sorted(ENGINE_BACKENDS)}")
    module_name, class_name = ENGINE_BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def make_engine(
    cfg: DraftlineConfig,
    target_dir: str | Path,
    drafter_dir: Optional[str | Path] = None,
    model_version: Optional[str] = None,
    speculative: Optional[SpeculativeConfig] = None,
) -> Engine:
    """An engine for `cfg.engine.backend` (not started: `await engine.start()`).

    drafter_dir None = target only (no speculation). model_version labels the drafter (e.g. its registry version);
    speculative overrides cfg.engine.speculative (the bench sweep uses it).
    """
    cls = engine_class(cfg.engine.backend)
    return cls(cfg, target_dir, drafter_dir=drafter_dir, model_version=model_version, speculative=speculative)


def add_engine_arg(parser) -> None:
    parser.add_argument("--engine", choices=sorted(ENGINE_BACKENDS), help="engine backend (overrides engine.backend)")


def with_engine_arg(cfg: DraftlineConfig, args) -> DraftlineConfig:
    if not getattr(args, "engine", None):
        return cfg
    cfg = cfg.model_copy(deep=True)
    cfg.engine.backend = args.engine
    return cfg
