"""Test helpers: a real MLflow store in a tmp dir holding randomly initialised, exported drafter versions."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from conftest import make_test_config


def mlflow_test_config(tmp_path: Path, extra: Optional[list[str]] = None):
    """The tiny test config (shared cached target) with MLflow in `tmp_path`."""
    return make_test_config(
        extra=[
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"tracking.artifact_location={(tmp_path / 'mlruns').as_uri()}",
        ]
        + list(extra or [])
    )


def random_drafter(target_dir: Path, draft_vocab_size: int = 256, seed: int = 0):
    """An Eagle3Drafter sized for the target at `target_dir`, randomly initialised (seeded)."""
    from transformers import AutoConfig

    from draftline.drafter.model import DrafterConfig, Eagle3Drafter
    from draftline.target.load import default_aux_layer_ids

    hf = AutoConfig.from_pretrained(target_dir)
    config = DrafterConfig.from_target(hf, draft_vocab_size, default_aux_layer_ids(hf.num_hidden_layers))
    torch.manual_seed(seed)
    return Eagle3Drafter(config).eval()


def register_drafter(cfg, drafter, tags: Optional[dict] = None, damage: Optional[Callable[[Path], None]] = None) -> str:
    """Export `drafter`, log it as a run artifact and register it; returns the version number.

    damage: called with the export directory before it is logged (to register a broken version on purpose)."""
    import mlflow

    from draftline.drafter.export import export_drafter
    from draftline.tracking import register_version, setup_mlflow

    setup_mlflow(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        export_dir = export_drafter(drafter, Path(tmp) / "drafter", meta={"test": True})
        if damage is not None:
            damage(export_dir)
        with mlflow.start_run() as run:
            mlflow.log_artifacts(str(export_dir), artifact_path="drafter")
    return register_version(cfg, run.info.run_id, "drafter", tags=tags)
