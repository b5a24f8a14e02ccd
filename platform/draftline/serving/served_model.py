"""Which registry version the engine replicas serve: the engine deployment's Serve user_config."""

from __future__ import annotations

import logging
from typing import Optional

from pydantic import BaseModel

from draftline.config import DraftlineConfig
from draftline.engines.base import TARGET_ONLY
from draftline.registry import CHAMPION, RegistryError, measured_speculative, resolve_alias, verify_export

logger = logging.getLogger("ray.serve")


class ServedModel(BaseModel):
    """The engine deployment's user_config: which registry version to serve (export_dir None = target only), and
    the speculative settings its bench sweep measured fastest (None = engine.speculative)."""

    registered_model: str
    model_version: str
    export_dir: Optional[str] = None
    speculative: Optional[dict] = None


def resolve_served_model(cfg: DraftlineConfig) -> ServedModel:
    """The champion from the registry, or the target alone when there is none and serve.allow_target_only."""
    try:
        resolved = resolve_alias(cfg, CHAMPION)
    except RegistryError as err:
        if not cfg.serve.allow_target_only:
            raise RegistryError(f"{err} (serve.allow_target_only is false, so there is nothing to serve)") from None
        logger.warning("serving the target alone: %s", err)
        return ServedModel(registered_model=cfg.registered_model_name, model_version=TARGET_ONLY)
    # Before any replica starts: a champion whose files were damaged since promotion fails here in seconds, with the
    # file named, rather than as DEPLOY_FAILED minutes later.
    verify_export(resolved)
    return served_version(cfg, resolved)


def served_version(cfg: DraftlineConfig, resolved) -> ServedModel:
    """A registry version as served: its files and the speculative settings its bench sweep measured fastest at the
    concurrency a replica serves (serve.max_ongoing_requests), if a sweep was stored on it."""
    measured = measured_speculative(resolved, cfg.serve.max_ongoing_requests, cfg.engine.speculative)
    if measured is not None:
        logger.info("serving version %s with its measured best speculative settings %s/%s/%s", resolved.version,
                    measured.num_steps, measured.eagle_topk, measured.num_draft_tokens)
    return ServedModel(registered_model=resolved.name, model_version=resolved.version, export_dir=str(resolved.export_dir),
                       speculative=measured.model_dump() if measured else None)
