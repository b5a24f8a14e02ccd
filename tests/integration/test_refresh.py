"""`draftline refresh` end to end on the test target: traffic store -> prepare -> extract -> train from the champion
(real Ray Train + DeepSpeed) -> two real gates -> promote, with a test-local MLflow store.

The traffic store is written with the store's real writer (ShardWriter) from conversations of the test dataset
(the embedded target's own replies, as served completions are) rather than by serving them: capture from a live
endpoint is covered by tests/integration/test_traffic.py.
"""

from __future__ import annotations

import mlflow
import pytest

from draftline.bench.prompts import prompt_from_sample
from draftline.data.prepare import load_split
from draftline.drafter.export import load_drafter
from draftline.refresh.run import refresh
from draftline.registry import CHAMPION, alias_version_number, get_version, promote
from draftline.serving.traffic_store import ShardWriter
from draftline.tracking import GATE_TAG, mlflow_client
from conftest import SMALL_BENCH
from registry_helpers import mlflow_test_config, random_drafter, register_drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAFFIC_REQUESTS = 16
SEGMENTS = ("team-a", "team-b")  # the clients' segment tags, alternating


def _capture(directory, dataset_dir, count: int = TRAFFIC_REQUESTS) -> None:
    """`count` chat requests of the test dataset's train split as the capture actor stores them, one a second."""
    writer = ShardWriter(directory, shard_bytes=4096, max_age_s=1e9, max_total_bytes=1 << 30)
    samples = [s for s in load_split(dataset_dir, "train") if s["messages"][-1]["role"] == "assistant"][:count]
    for i, sample in enumerate(samples):
        writer.append([{"id": f"chatcmpl-{i}", "time_s": 1_800_000_000.0 + i, "route": "chat",
                        "segment": SEGMENTS[i % 2], "model_version": "1", "messages": sample["messages"][:-1],
                        "prompt_token_ids": prompt_from_sample(sample),
                        "completion_text": sample["messages"][-1]["content"]}])
    writer.close()


def _config(tmp_path, extra: list[str]):
    # A cheap gate (2 paired rounds, 4 prompts, concurrency 1) and 4 training steps on one worker; speed is relaxed:
    # wall-clock speed on a shared test machine is not what these tests are about.
    return mlflow_test_config(tmp_path, SMALL_BENCH + [
        "bench.concurrency=[1]", "gate.min_rounds=2", "gate.max_rounds=2", "gate.min_speedup=0.01",
        "gate.min_accept_len=1.0", "gate.max_p99_latency_ratio=100", f"serve.traffic.dir={tmp_path / 'traffic'}",
        f"train.storage_uri={tmp_path / 'ray-train'}", "train.num_workers=1", "train.micro_batch_size=4",
        "train.val_every=2", "train.checkpoint_every=2", "refresh.min_records=10", "refresh.held_out_fraction=0.25",
        "refresh.train_steps=4", "refresh.replay_ratio=0.5", *extra,
    ])


def _champion(cfg, drafter) -> str:
    version = register_drafter(cfg, drafter)
    mlflow_client(cfg).set_model_version_tag(cfg.registered_model_name, version, GATE_TAG, "passed")
    promote(cfg, version)
    return version


def test_a_refresh_that_does_not_beat_the_champion_promotes_nothing(ray_cluster, tmp_path, tiny_target_dir,
                                                                    tiny_dataset_dir, fitted_drafter_dir):
    """The candidate must beat the champion by an accept length of 100 on the held-out traffic: it cannot, so the
    gate fails there, the original bench set is not gated, and the champion alias stays where it was."""
    cfg = _config(tmp_path, ["gate.champion_margin=100"])
    _capture(tmp_path / "traffic", tiny_dataset_dir)
    champion = _champion(cfg, load_drafter(fitted_drafter_dir))

    record = refresh(cfg)

    assert not record.promoted and record.traffic_gate == "failed" and record.bench_gate is None
    assert record.version != champion and record.champion_version == champion
    assert alias_version_number(cfg, CHAMPION) == champion
    candidate = get_version(cfg, record.version, download=False)
    assert candidate.tags[GATE_TAG] == "failed" and "champion" in candidate.tags["gate_reasons"]
    assert candidate.tags["refresh.champion_version"] == champion
    assert candidate.tags["refresh.traffic_held_out_requests"] == "4"
    run = mlflow_client(cfg).get_run(candidate.run_id)
    assert run.data.params["train.init_from"] == str(get_version(cfg, champion).export_dir)
    assert run.data.tags["refresh.traffic_window_hash"] == record.window["refresh.traffic_window_hash"]


def test_a_refresh_that_beats_the_champion_is_tagged_with_its_window_and_promoted(ray_cluster, tmp_path,
                                                                                  tiny_target_dir, tiny_dataset_dir):
    """The champion is a random drafter (almost every draft rejected); trained further on the traffic for 10 steps,
    the candidate beats it by the margin on the held-out traffic, in each client segment too, holds on the original
    bench set, and becomes the champion."""
    cfg = _config(tmp_path, ["refresh.train_steps=10", "train.val_every=5", "train.checkpoint_every=5",
                             "gate.champion_margin=0.1"])
    _capture(tmp_path / "traffic", tiny_dataset_dir)
    vocab_size = cfg.data.draft_vocab_size
    champion = _champion(cfg, random_drafter(tiny_target_dir, vocab_size, seed=5))

    record = refresh(cfg)

    assert record.traffic_gate == "passed" and record.bench_gate == "passed", record.reasons
    assert record.promoted and alias_version_number(cfg, CHAMPION) == record.version != champion
    tags = get_version(cfg, record.version, download=False).tags
    assert tags[GATE_TAG] == "passed"
    assert tags["refresh.traffic_from_s"] == "1800000000.000"
    assert tags["refresh.traffic_to_s"] == f"{1_800_000_000.0 + TRAFFIC_REQUESTS - 1:.3f}"
    assert tags["refresh.held_out_from_s"] == f"{1_800_000_000.0 + TRAFFIC_REQUESTS - 4:.3f}"
    assert tags["refresh.traffic_segments"] == "team-a,team-b"
    gate_runs = mlflow.search_runs(experiment_names=[cfg.tracking.experiment], output_format="list",
                                   filter_string=f"tags.model_version = '{record.version}' and tags.gate = 'passed'")
    per_segment = [run.data.metrics for run in gate_runs if "check_champion/team-a" in run.data.metrics]
    assert len(gate_runs) == 2 and len(per_segment) == 1  # the held-out traffic's gate checked each client segment
    assert per_segment[0]["check_champion/team-a"] == per_segment[0]["check_champion/team-b"] == 1.0
