"""`draftline promote` / `rollback`: change what users get served, as one transaction over registry and serving.

The registry (registry.py) only moves aliases; serving (serving/control.py) only rolls replicas to a version it is
given. This module sits above both and is the one trigger for a rollout:
1. The version to serve is checked first: gate passed (promote), files downloaded and verified (registry.verify_export).
2. If a Serve app runs for this data dir, it is rolled to that version and every replica must answer with it.
   A roll that fails is rolled back to the version served before, and the registry is left as it was.
3. Only then do the aliases move. If that fails, serving goes back to what it served before.
With nothing serving, step 2 is skipped: the alias moves once the files verify, and the next `draftline serve` loads them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

from draftline.config import DraftlineConfig
from draftline.records import StageRecord
from draftline.registry import (
    CHAMPION,
    PREVIOUS,
    ResolvedVersion,
    alias_version_number,
    promote,
    promotion_candidate,
    restore_aliases,
    rollback,
    rollback_candidate,
)
from draftline.serving.control import ServingError, roll_to, serving_now
from draftline.serving.served_model import resolve_served_model, served_version

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromoteRecord(StageRecord):
    """The promote stage's output: whether the gated version became the champion."""

    STAGE = "promote"
    promoted: bool
    version: str


class ReleaseError(RuntimeError):
    """A promotion or rollback that did not happen; the message says what state things were left in."""


def promote_and_roll(cfg: DraftlineConfig, version: str | int) -> str:
    """Serve `version` (rolling a running app first), then make it the champion; returns what was done."""
    return _transaction(cfg, promotion_candidate(cfg, version), lambda: promote(cfg, version))


def rollback_and_roll(cfg: DraftlineConfig) -> str:
    """Serve the `previous` version (rolling a running app first), then point `champion` back at it."""
    return _transaction(cfg, rollback_candidate(cfg), lambda: rollback(cfg))


def _transaction(cfg: DraftlineConfig, wanted: ResolvedVersion, move_aliases: Callable[[], str]) -> str:
    aliases_before = (alias_version_number(cfg, CHAMPION), alias_version_number(cfg, PREVIOUS))
    before = serving_now(cfg)
    target = served_version(cfg, wanted)
    rolled = before is not None and before != target
    if rolled:
        try:
            roll_to(cfg, target)
        except ServingError as err:
            raise ReleaseError(
                f"serving did not roll to {wanted.name} version {wanted.version}: {err}. "
                f"{_restore_serving(cfg, before)} The registry is unchanged."
            ) from None
    try:
        message = move_aliases()
    except Exception as err:  # noqa: BLE001 - whatever failed, serving must not stay ahead of the registry
        if rolled:
            restore_aliases(cfg, *aliases_before)
            raise ReleaseError(f"the registry could not be updated ({err}); {_restore_serving(cfg, before)}") from err
        raise
    if before is None:
        return f"{message}; nothing is serving for {cfg.data_dir}, the next `draftline serve` loads it"
    return f"{message}; Serve app now serves {wanted.name} version {wanted.version}"


def _restore_serving(cfg: DraftlineConfig, before) -> str:
    try:
        roll_to(cfg, before)
    except ServingError as err:
        return f"Rolling serving back to version {before.model_version} failed too ({err}): check `/healthz`."
    return f"Serving is back on version {before.model_version}."


def sync_serving_to_champion(cfg: DraftlineConfig) -> Optional[str]:
    """`draftline serve --roll`: bring a running app to the current champion; None when nothing serves."""
    if serving_now(cfg) is None:
        return None
    served = roll_to(cfg, resolve_served_model(cfg))
    return f"Serve app now serves {served.registered_model} version {served.model_version}"
