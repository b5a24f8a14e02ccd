"""Shared by the training tests: hidden states of the test target (extracted once, cached by hash) and run configs."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import make_test_config


def hidden_states_of_test_target(tiny_cfg, tiny_dataset_dir) -> Path:
    from draftline.extract.run import extract

    return Path(extract(tiny_cfg, tiny_dataset_dir))


def short_run_config(data_dir: Path, extra: list[str] | None = None):
    """A 2-worker CPU run of a few steps; MLflow (sqlite), Ray checkpoints and exports all go under data_dir."""
    return make_test_config(data_dir=data_dir, extra=[
        "train.num_workers=2",
        "train.micro_batch_size=4",
        "train.warmup_steps=2",
        "train.val_every=3",
        "train.checkpoint_every=3",
        *(extra or []),
    ])
