"""A real 2-worker Ray Train + DeepSpeed run on the test target: export, MLflow run and registered version."""

from __future__ import annotations

import json

import pytest
import torch

from draftline.drafter.export import load_drafter, read_export_meta
from draftline.drafter.model import Eagle3Drafter
from draftline.extract.shards import HiddenStateShards
from draftline.tracking import mlflow_client
from draftline.train.run import train
from tests.train_helpers import SHORT_RUN_STEPS as MAX_STEPS


def test_short_two_worker_run_exports_logs_and_registers(short_offline_run, tiny_target_dir, tiny_dataset_dir):
    """The shared short run (conftest.short_offline_run), whichever test trained it first."""
    cfg, hidden_dir, result = short_offline_run

    manifest = HiddenStateShards(hidden_dir / "train").manifest
    drafter = load_drafter(result.export_dir)
    assert list(drafter.config.aux_layer_ids) == manifest["aux_layer_ids"]
    meta = read_export_meta(result.export_dir)
    assert meta["target_fingerprint"] == manifest["target_fingerprint"]
    assert meta["dataset_hash"] == manifest["dataset_hash"]
    assert meta["step"] == result.best_step

    # Tracking and registry of the run's own store: a bare MlflowClient(tracking_uri=...) reads the registry this
    # process last pointed MLflow at, another test's store when another test trained the shared run.
    client = mlflow_client(cfg)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == str(MAX_STEPS)
    # The suite's one Ray Train + DeepSpeed run on the production attention path, packed.
    assert (run.data.params["train.attention"], run.data.params["train.packing"]) == ("fused", "True")
    loss_steps = sorted(m.step for m in client.get_metric_history(result.run_id, "loss"))
    assert loss_steps == list(range(1, MAX_STEPS + 1))
    val_history = {m.step: m.value for m in client.get_metric_history(result.run_id, "val_est_accept_len")}
    assert sorted(val_history) == [3, 6]
    # Export and registry carry the best validation checkpoint, not merely the last one.
    assert result.best_step == max(val_history, key=val_history.get)
    assert result.metrics["val_est_accept_len"] == pytest.approx(val_history[result.best_step])
    for name in ("acc_0", "loss_0", "lr", "tokens_per_s", "val_acc_0", "val_loss_0", "padding_fraction",
                 "padding_fraction_unpacked", "run_padding_fraction", "run_padding_fraction_unpacked", "step_cpu_s",
                 "tokens_per_cpu_s"):
        assert client.get_metric_history(result.run_id, name), f"metric {name} was not logged"
    assert all(m.value > 0 for m in client.get_metric_history(result.run_id, "tokens_per_cpu_s"))
    padding = {name: run.data.metrics[f"run_{name}"] for name in ("padding_fraction", "padding_fraction_unpacked")}
    # The test config packs: the same samples with less padding than one sample a row.
    assert 0 <= padding["padding_fraction"] < padding["padding_fraction_unpacked"] < 1
    artifacts = {a.path for a in client.list_artifacts(result.run_id, "drafter")}
    assert {"drafter/config.json", "drafter/model.safetensors", "drafter/draftline.json"} <= artifacts

    version = client.get_model_version(cfg.registered_model_name, result.model_version)
    assert version.run_id == result.run_id
    assert version.tags["target_fingerprint"] == manifest["target_fingerprint"]
    assert version.tags["dataset_hash"] == manifest["dataset_hash"]
    assert version.tags["git_commit"]
    assert float(version.tags["val_est_accept_len"]) == pytest.approx(result.metrics["val_est_accept_len"], abs=1e-4)
    assert float(version.tags["val_acc_0"]) == pytest.approx(result.metrics["val_acc_0"], abs=1e-4)

    # The export holds trained weights, not the initial ones (workers initialise with torch.manual_seed(cfg.seed)).
    torch.manual_seed(cfg.seed)
    initial = Eagle3Drafter(drafter.config)
    assert not torch.allclose(initial.fc.weight, drafter.fc.weight)
    with open(result.export_dir.parent / "train_result.json") as handle:
        assert json.load(handle)["model_version"] == result.model_version

    again = train(cfg, hidden_dir, tiny_dataset_dir, tiny_target_dir)
    assert again.cached and again.model_version == result.model_version
