"""Online mode on a real local Ray: the test target runs in a Ray Data actor pool and streams its states into a real
2-worker Ray Train + DeepSpeed run. Against one offline run on the same data and seed (module fixture): the same
per-step losses and metrics, no shard written, bytes per token streamed printed and logged; a killed target actor and
a killed training worker lose and repeat no sample.

Kept cheap: three trainings of 6 steps per module (the offline reference, an online run whose target actor is
killed mid-stream, an online run whose training worker is killed); process start-up (Ray Train workers, DeepSpeed,
target actors) is most of each one's time."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from draftline import faults
from draftline.extract.shards import stored_bytes_per_token
from draftline.train.run import train
from tests.train_helpers import SHORT_RUN_STEPS, short_run_config

# Per test (setup included): the offline fixture alone took over 900 s at load 20-100 on the shared 2-core box.
pytestmark = pytest.mark.timeout(1200)

MAX_STEPS = SHORT_RUN_STEPS  # short_run_config validates and checkpoints every 3 steps: at 3 and 6
VAL_STEPS = [3, 6]
KILL_AT_STEP = 5  # after the step-3 checkpoint, before the step-6 one
# Each rank's stream: 6 steps x 4 samples + 2 x 10 val samples = 44 rows = 6 target batches of 8; the actor dies
# after its 3rd, half-way through the stream.
ACTOR_DIES_AFTER_BATCHES = 3
# 0.5 CPU per target actor: 2 training workers, Ray Train's controller and 2 actors fit the 4 logical CPUs of the
# test cluster.
ONLINE = [f"train.max_steps={MAX_STEPS}", "extract.mode=online", "extract.cpus_per_worker=0.5"]
# Per-step losses: online batches pad differently in the target forward than shard extraction (the tiny target's
# states agree to ~1e-6, see test_batched_right_padded_equals_one_at_a_time), so equal to float tolerance.
LOSS_RTOL = 1e-4


def history(cfg, run_id: str, metric: str) -> dict[int, float]:
    """step -> the last value logged (a step redone after a resume is logged twice)."""
    from mlflow import MlflowClient

    entries = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri).get_metric_history(run_id, metric)
    return {m.step: m.value for m in sorted(entries, key=lambda m: m.timestamp)}


@pytest.fixture(scope="module")
def offline_run(short_offline_run):
    """The reference: the same run trained on shards (conftest.short_offline_run, shared with other tests)."""
    cfg, _, result = short_offline_run
    return cfg, result


def assert_same_losses(online_cfg, online_result, offline_run):
    offline_cfg, offline_result = offline_run
    for metric, steps in (("loss", range(1, MAX_STEPS + 1)), ("acc_0", range(1, MAX_STEPS + 1)),
                          ("loss_6", range(1, MAX_STEPS + 1)), ("tokens_seen", range(1, MAX_STEPS + 1)),
                          ("val_loss", VAL_STEPS), ("val_est_accept_len", VAL_STEPS)):
        online = history(online_cfg, online_result.run_id, metric)
        offline = history(offline_cfg, offline_result.run_id, metric)
        assert sorted(online) == sorted(offline) == list(steps), metric
        for step in steps:
            assert online[step] == pytest.approx(offline[step], rel=LOSS_RTOL, abs=1e-6), f"{metric} at step {step}"


def shard_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("shard-*") if p.is_file()]


def test_online_run_with_a_killed_target_actor_has_the_offline_losses_and_writes_no_shards(
        offline_run, tiny_target_dir, tiny_dataset_dir, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "target-actor-killed"
    monkeypatch.setenv(faults.ENV, faults.encode(faults.Fault("online.batches", ACTOR_DIES_AFTER_BATCHES, str(marker))))
    # No training restart allowed: a stream that failed on the dead actor would otherwise be rerun by Ray Train from
    # scratch (no checkpoint yet) and the losses would still match.
    cfg = short_run_config(tmp_path / "run", [*ONLINE, "train.max_failures=0"])
    result = train(cfg, None, tiny_dataset_dir, tiny_target_dir)

    # The killed actor: Ray Data restarted it and retried its batch; training did not restart. The worker checks
    # every row against the training order (StreamOrderError otherwise) and the losses show the batches were the
    # offline ones, each step once.
    assert marker.exists(), "the fault hook did not fire: the test would prove nothing"
    assert history(cfg, result.run_id, "resumed_at_step") == {}, "an actor death must not restart training"
    assert_same_losses(cfg, result, offline_run)

    assert not (tmp_path / "run" / "hidden").exists() and shard_files(tmp_path) == [], "online mode wrote hidden states"
    # Bytes per token streamed: 3 aux + 1 final state x 96 x fp32, token id and mask; printed before training, a
    # param, and measured by rank 0 from the arrays it received.
    per_token = stored_bytes_per_token(3, 96, "float32")
    assert f"stream {per_token} bytes per token through Ray's object store" in capsys.readouterr().out
    from mlflow import MlflowClient

    params = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri).get_run(result.run_id).data.params
    assert params["inputs.streamed_bytes_per_token"] == f"{per_token:.1f}"
    assert set(history(cfg, result.run_id, "streamed_bytes_per_token").values()) == {per_token}
    offline_cfg, offline_result = offline_run
    offline_params = MlflowClient(tracking_uri=offline_cfg.mlflow_tracking_uri).get_run(offline_result.run_id).data.params
    assert float(offline_params["inputs.stored_bytes_per_token"]) >= per_token  # plus safetensors headers


def test_a_killed_training_worker_resumes_the_stream_where_its_checkpoint_left_it(
        offline_run, tiny_target_dir, tiny_dataset_dir, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    marker = tmp_path / "worker-killed"
    monkeypatch.setenv(faults.ENV, faults.encode(faults.Fault("train.step", KILL_AT_STEP, str(marker))))
    cfg = short_run_config(tmp_path / "run", [*ONLINE, "train.max_failures=2"])
    result = train(cfg, None, tiny_dataset_dir, tiny_target_dir)

    assert marker.exists(), "the kill hook did not fire: the test would prove nothing"
    assert history(cfg, result.run_id, "resumed_at_step") == {3: 3.0}
    logged = Counter(m.step for m in MlflowClient(tracking_uri=cfg.mlflow_tracking_uri).get_metric_history(result.run_id, "loss"))
    assert all(logged[step] == 1 for step in (1, 2, 3)), "steps before the checkpoint were not redone"
    # Steps 4.. were trained on the stream restarted after step 3: the same samples as offline, none skipped or
    # repeated (the losses, and tokens_seen, which counts every real token trained on).
    assert_same_losses(cfg, result, offline_run)
