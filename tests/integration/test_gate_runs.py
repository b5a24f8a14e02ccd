"""Real gate runs that tag registered versions in a test-local MLflow store and drive promotion."""

from __future__ import annotations

import mlflow
import pytest

from draftline.gate import run_gate
from draftline.registry import PromotionRefused, promote
from draftline.tracking import GATE_REASONS_TAG, GATE_RUN_TAG, GATE_TAG, mlflow_client
from conftest import SMALL_BENCH
from registry_helpers import mlflow_test_config, random_drafter, register_drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_gate_runs_tag_versions_and_drive_promotion(tmp_path, monkeypatch, tiny_target_dir, tiny_dataset_dir,
                                                   fitted_drafter_dir):
    """A fitted drafter passes and is promoted; a random one fails (accept length) and promotion refuses it.
    The fitted one's run carries the dataset it was trained on, as a training run does: its gate benches on that
    dataset's bench split without running prepare; the random one's has none, so its gate prepares."""
    import draftline.data.prepare
    from draftline.drafter.export import load_drafter

    # min_speedup is relaxed: wall-clock speed on a shared test machine is not what this test is about.
    cfg = mlflow_test_config(tmp_path, SMALL_BENCH + ["bench.concurrency=[1]", "gate.min_speedup=0.2",
                                                       "gate.min_accept_len=1.5", "gate.max_p99_latency_ratio=100"])  # fmt: skip
    fitted = load_drafter(fitted_drafter_dir)
    good = register_drafter(cfg, fitted)
    bad = register_drafter(cfg, random_drafter(tiny_target_dir, 512, seed=5))
    client = mlflow_client(cfg)
    client.set_tag(client.get_model_version(cfg.registered_model_name, good).run_id, "dataset_hash",
                   tiny_dataset_dir.name)

    prepare = draftline.data.prepare.prepare
    monkeypatch.setattr(draftline.data.prepare, "prepare", lambda *a: pytest.fail("the gate ran prepare"))
    decision = run_gate(cfg, good, log=lambda _: None)
    monkeypatch.setattr(draftline.data.prepare, "prepare", prepare)
    assert decision.passed, decision.reasons
    tags = mlflow_client(cfg).get_model_version(cfg.registered_model_name, good).tags
    assert tags[GATE_TAG] == "passed" and tags[GATE_RUN_TAG] == decision.run_id
    run = mlflow.get_run(decision.run_id)
    assert run.data.tags["model_version"] == good and run.data.tags["gate"] == "passed"
    assert run.data.metrics["accept_length"] > 1.5
    promote(cfg, good)

    decision = run_gate(cfg, None, log=lambda _: None)  # default: the latest version, i.e. `bad`
    assert decision.version == bad and not decision.passed and decision.champion_version == good
    tags = mlflow_client(cfg).get_model_version(cfg.registered_model_name, bad).tags
    assert tags[GATE_TAG] == "failed" and "accept length" in tags[GATE_REASONS_TAG]
    with pytest.raises(PromotionRefused, match="failed the gate"):
        promote(cfg, bad)
