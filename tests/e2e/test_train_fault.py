"""A training worker SIGKILLed mid-run: Ray Train restarts the group from the last checkpoint and the run continues
(step counter, data position and MLflow metrics) to the same final step instead of starting over. A full disk: no
retried training, one clear line."""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest

from draftline import faults
from draftline.extract.shards import HiddenStateShards
from draftline.train.order import sample_indices_for_step
from draftline.train.run import train
from draftline.utils import StorageFullError
from tests.train_helpers import hidden_states_of_test_target, short_run_config


MAX_STEPS = 8
KILL_AT_STEP = 5  # after the step-3 checkpoint, before the step-6 one


def expected_tokens_seen(shards: HiddenStateShards, steps: int, world_size: int, micro_batch_size: int, seed: int) -> int:
    sizes = [s["samples"] for s in shards.manifest["shards"]]
    return sum(
        len(shards[i]["input_ids"])
        for step in range(steps)
        for rank in range(world_size)
        for i in sample_indices_for_step(step, rank, world_size, micro_batch_size, sizes, seed)
    )


def test_killed_worker_resumes_from_checkpoint(ray_cluster, tiny_cfg, tiny_target_dir, tiny_dataset_dir, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    marker = tmp_path / "worker-killed"
    monkeypatch.setenv(faults.ENV, faults.encode(faults.Fault("train.step", KILL_AT_STEP, str(marker))))
    hidden_dir = hidden_states_of_test_target(tiny_cfg, tiny_dataset_dir)
    cfg = short_run_config(tmp_path, [f"train.max_steps={MAX_STEPS}", "train.max_failures=2"])
    result = train(cfg, hidden_dir, tiny_dataset_dir, tiny_target_dir)

    assert marker.exists(), "the kill hook did not fire: the test would prove nothing"
    client = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
    resumed = client.get_metric_history(result.run_id, "resumed_at_step")
    assert [m.value for m in resumed] == [3.0], "the restarted workers must resume from the step-3 checkpoint"

    loss_steps = Counter(m.step for m in client.get_metric_history(result.run_id, "loss"))
    assert sorted(loss_steps) == list(range(1, MAX_STEPS + 1)), "every step up to max_steps is logged"
    assert all(loss_steps[step] == 1 for step in (1, 2, 3)), "steps before the checkpoint were not redone"
    val_steps = sorted(m.step for m in client.get_metric_history(result.run_id, "val_est_accept_len"))
    assert val_steps == [3, 6, 8]

    # The data position continued: tokens seen equals one uninterrupted pass over steps 0..MAX_STEPS-1.
    train_shards = HiddenStateShards(hidden_dir / "train")
    expected = expected_tokens_seen(train_shards, MAX_STEPS, cfg.train.num_workers, cfg.train.micro_batch_size, cfg.seed)
    tokens_history = client.get_metric_history(result.run_id, "tokens_seen")
    assert max(m.step for m in tokens_history) == MAX_STEPS
    assert [m.value for m in tokens_history if m.step == MAX_STEPS][-1] == expected
    assert result.best_step in (3, 6, 8)


def test_a_full_checkpoint_disk_fails_in_one_line_without_training_again(ray_cluster, tiny_cfg, tiny_target_dir,
                                                                         tiny_dataset_dir, tmp_path, one_mb_tmpfs):
    """Checkpoints on a real 1 MB file system: the first checkpoint (step 3) does not fit. Ray Train retries every
    worker error, so each of train.max_failures=3 attempts trained to step 3 and failed the same way."""
    from mlflow import MlflowClient
    from ray.util.state import list_actors

    import ray

    def train_workers() -> int:
        return len(list_actors(address=ray.get_runtime_context().gcs_address, limit=10_000,
                               filters=[("class_name", "=", "RayTrainWorker")]))

    hidden_dir = hidden_states_of_test_target(tiny_cfg, tiny_dataset_dir)
    cfg = short_run_config(tmp_path, ["train.max_steps=6", "train.max_failures=3",
                                      f"train.storage_uri={one_mb_tmpfs / 'checkpoints'}"])
    workers_before = train_workers()
    started = time.monotonic()
    with pytest.raises(StorageFullError) as raised:
        train(cfg, hidden_dir, tiny_dataset_dir, tiny_target_dir)
    print(f"full checkpoint disk reported after {time.monotonic() - started:.1f} s: {raised.value}")
    assert re.match(rf"cannot write {one_mb_tmpfs}/checkpoints/train-\w+: No space left on device \(0\.\d MB free "
                    r"there\); free space or point train.storage_uri \(or data_dir\)", str(raised.value))
    # One group trained and failed; Ray Train's retry started one more group that returned at once.
    assert train_workers() - workers_before == 2 * cfg.train.num_workers
    client = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
    # This training's run, by the training hash its checkpoint directory is named after (in the full suite the
    # experiment has held another run beside it once; which, was not established).
    training_hash = re.search(r"/checkpoints/train-(\w+)", str(raised.value)).group(1)
    experiment_id = client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
    runs = client.search_runs(experiment_id, filter_string=f"tags.training_hash = '{training_hash}'")
    assert len(runs) == 1, [(r.info.run_name, r.info.status, r.data.tags) for r in runs]
    (run,) = runs
    assert run.info.status == "FAILED"
    assert sorted(Counter(m.step for m in client.get_metric_history(run.info.run_id, "loss")).items()) == [
        (1, 1), (2, 1), (3, 1)], "no step may be trained twice"
