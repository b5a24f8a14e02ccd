"""Shared by the training tests: hidden states of the test target (extracted once, cached by hash), run configs, and
one short training run that every test needing "a finished run" shares (trained once per test data dir)."""

from __future__ import annotations

from pathlib import Path

from draftline.utils import file_lock
from tests.conftest import make_test_config, shared_data_dir

SHORT_RUN_STEPS = 6  # short_run_config validates and checkpoints every 3 steps: at 3 and 6
# Test processes share these caches; a cold extraction or training takes minutes on 2 busy cores.
SHARED_BUILD_DEADLINE_S = 1800


def hidden_states_of_test_target(tiny_cfg, tiny_dataset_dir) -> Path:
    from draftline.extract.run import extract

    with file_lock(Path(shared_data_dir()) / ".hidden-states.lock", SHARED_BUILD_DEADLINE_S,
                   "the test target's hidden states"):  # fmt: skip
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


def shared_short_run(tiny_cfg, tiny_target_dir, tiny_dataset_dir):
    """(cfg, hidden_dir, TrainResult) of the 6-step offline run on the test target, trained by the first test that
    asks and found in the training cache (keyed by content hash) by every later one, in any test process."""
    from draftline.train.run import train

    # A directory of its own: the training hash leaves out the attention path and packing (the same loss), so a run
    # cached by code that trained otherwise would be found under the old one.
    data_dir = Path(shared_data_dir()) / "runs" / "short-offline-fused-packed"
    hidden_dir = hidden_states_of_test_target(tiny_cfg, tiny_dataset_dir)
    # The production attention path (the other tests train blocked, conftest.CHEAP_TRAIN_ATTENTION), packed into rows
    # of data.max_seq_len: a micro-batch of the short test samples fills one row, where rows as long as its longest
    # sample (the default) rarely take two of them.
    cfg = short_run_config(data_dir, [
        f"train.max_steps={SHORT_RUN_STEPS}", "train.attention=fused", "train.packing=true",
        "train.packed_row_tokens=256",
    ])
    with file_lock(data_dir.parent / ".short-offline.lock", SHARED_BUILD_DEADLINE_S, "the shared short training run"):
        return cfg, hidden_dir, train(cfg, hidden_dir, tiny_dataset_dir, tiny_target_dir)
