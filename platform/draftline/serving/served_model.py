"""Which registry version the engine replicas serve: the engine deployment's Serve user_config."""

from __future__ import annotations

import logging
from typing import Optional

from pydantic import BaseModel

from draftline.config import DraftlineConfig
from draftline.engines.base import TARGET_ONLY
from draftline.registry import CHAMPION, RegistryError, resolve_alias, verify_export

logger = logging.getLogger("ray.serve")


class ServedModel(BaseModel):
    """The engine deployment's user_config: which registry version to serve (export_dir None = target only)."""

    registered_model: str
    model_version: str
    export_dir: Optional[str] = None


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
    return ServedModel(registered_model=resolved.name, model_version=resolved.version, export_dir=str(resolved.export_dir))
