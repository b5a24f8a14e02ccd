"""Test helpers: a real MLflow store in a tmp dir holding randomly initialised, exported drafter versions."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from conftest import make_test_config


def mlflow_overrides(tmp_path: Path) -> list[str]:
    """Dotted overrides that put MLflow's tracking store and artifacts in `tmp_path`."""
    return [
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"tracking.artifact_location={(tmp_path / 'mlruns').as_uri()}",
    ]


def mlflow_test_config(tmp_path: Path, extra: Optional[list[str]] = None):
    """The tiny test config (shared cached target) with MLflow in `tmp_path`."""
    return make_test_config(extra=mlflow_overrides(tmp_path) + list(extra or []))


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
    from draftline.drafter.export import export_drafter

    with tempfile.TemporaryDirectory() as tmp:
        export_dir = export_drafter(drafter, Path(tmp) / "drafter", meta={"test": True})
        if damage is not None:
            damage(export_dir)
        return register_export_dir(cfg, export_dir, tags)


def register_export_dir(cfg, export_dir: Path, tags: Optional[dict] = None) -> str:
    """Register an export directory as the train stage does (`tracking.register_export`, in an MLflow run of its
    own); returns the version number."""
    import mlflow

    from draftline.tracking import register_export, setup_mlflow

    setup_mlflow(cfg)
    with mlflow.start_run() as run:
        return register_export(cfg, run.info.run_id, export_dir, tags=tags)
