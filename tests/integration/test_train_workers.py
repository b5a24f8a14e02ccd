"""The training worker group on a real Ray cluster, without training: starts the cluster cannot fit, and a full disk.

A group the cluster cannot fit fails within train.start_timeout_s, naming what it waited for, instead of waiting
forever (Ray Train retries a start that timed out as a controller failure, by default forever)."""

from __future__ import annotations

import pytest

import torch

from conftest import make_test_config
from draftline.drafter.model import DrafterConfig
from draftline.train.job import TrainingJob
from draftline.train.loop import train_loop_per_worker
from draftline.train.run import WorkerStartTimeoutError, _run_workers
from draftline.utils import StorageFullError, StorageFullSink


def job_of(cfg) -> TrainingJob:
    """A job for workers that never get to read it (they never start, or fail first)."""
    drafter_config = DrafterConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   intermediate_size=64, draft_vocab_size=8, target_vocab_size=16,
                                   target_hidden_size=32, aux_layer_ids=(0, 1, 2))
    return TrainingJob(cfg=cfg, target_dir="", d2t=torch.zeros(8, dtype=torch.long), t2d=torch.zeros(16, dtype=torch.bool),
                       drafter_config=drafter_config, tracking_uri="", run_id="")


def test_workers_the_cluster_cannot_fit_fail_at_the_deadline_naming_the_resources(ray_cluster, tmp_path):
    cfg = make_test_config(tmp_path, ["train.cpus_per_worker=64", "train.start_timeout_s=3", "train.max_failures=1"])
    with pytest.raises(WorkerStartTimeoutError) as raised:
        _run_workers(job_of(cfg), run_name="never-starts")
    message = str(raised.value)
    assert "waited 3 s (train.start_timeout_s), 2 time(s), for 2 worker(s) of {'CPU': 64.0} each" in message, message
    assert "the cluster has {'CPU': " in message and "raise train.start_timeout_s" in message


def test_a_full_disk_stops_the_worker_group_and_its_retry_does_not_train(ray_cluster, monkeypatch):
    """Ray Train retries every worker error (FailureConfig.max_failures), so a full disk restarted the group to fail
    the same way. Now the failing rank leaves the message with the driver's sink, and the retried workers return
    before building anything."""
    import ray

    import draftline.train.loop as loop_module

    attempts = []

    def train_until_the_disk_fills(job):
        attempts.append(len(attempts))
        raise StorageFullError("cannot write /ck: No space left on device")

    monkeypatch.setattr(loop_module, "_train", train_until_the_disk_fills)
    sink = ray.remote(num_cpus=0)(StorageFullSink).remote()
    try:
        loop_config = job_of(make_test_config()).with_run("/ck", storage_full_sink=sink, online=None).to_loop_config()
        with pytest.raises(StorageFullError):
            train_loop_per_worker(loop_config)
        assert ray.get(sink.messages.remote()) == ["cannot write /ck: No space left on device"]
        train_loop_per_worker(loop_config)  # Ray Train's retry of the group
        assert attempts == [0], "the retried worker must not train again"
    finally:
        ray.kill(sink)
