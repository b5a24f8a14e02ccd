"""Registry aliases against a real MLflow sqlite store in a tmp dir, with randomly initialised exported drafters."""

from __future__ import annotations

import pytest

from draftline.drafter.export import load_drafter
from draftline.registry import (
    PromotionRefused,
    RegistryError,
    alias_version_number,
    latest_version,
    promote,
    resolve_alias,
    rollback,
)
from draftline.tracking import GATE_TAG, register_version
from registry_helpers import mlflow_test_config, random_drafter, register_drafter


@pytest.fixture(scope="module")
def logged_drafter(tmp_path_factory, tiny_target_dir):
    """One MLflow store and one logged export per module (creating a sqlite store costs seconds)."""
    cfg = mlflow_test_config(tmp_path_factory.mktemp("mlflow"))
    version = register_drafter(cfg, random_drafter(tiny_target_dir))
    from draftline.tracking import mlflow_client

    run_id = mlflow_client(cfg).get_model_version(cfg.registered_model_name, version).run_id
    return cfg, run_id


@pytest.fixture()
def store(logged_drafter, request):
    """A fresh registered model per test (its own name), versions 1-4 over the same logged export."""
    base_cfg, run_id = logged_drafter
    cfg = base_cfg.model_copy(deep=True)
    cfg.tracking.registered_model = f"draftline-test-{request.node.name.replace('[', '-').replace(']', '')}"
    tags = {
        "passed_a": {GATE_TAG: "passed"},
        "passed_b": {GATE_TAG: "passed"},
        "failed": {GATE_TAG: "failed", "gate_reasons": "accept length 1.1 < 1.8"},
        "never": {},
    }
    versions = {key: register_version(cfg, run_id, "drafter", tags=value) for key, value in tags.items()}
    return cfg, versions


def test_register_version_numbers_and_latest(store):
    cfg, versions = store
    assert sorted(int(v) for v in versions.values()) == [1, 2, 3, 4]
    assert latest_version(cfg) == "4"


def test_promote_moves_champion_and_previous_and_resolves_to_a_loadable_export(store):
    cfg, versions = store
    assert alias_version_number(cfg) is None
    message = promote(cfg, versions["passed_a"])
    assert "no champion" in message
    champion = resolve_alias(cfg)
    assert champion.version == versions["passed_a"]
    assert champion.tags[GATE_TAG] == "passed"
    assert load_drafter(champion.export_dir).config.draft_vocab_size == 256

    message = promote(cfg, versions["passed_b"])
    assert f"previous champion {versions['passed_a']}" in message
    assert alias_version_number(cfg, "champion") == versions["passed_b"]
    assert alias_version_number(cfg, "previous") == versions["passed_a"]
    assert "already the champion" in promote(cfg, versions["passed_b"])


@pytest.mark.parametrize("which, phrase", [("failed", "failed the gate (accept length 1.1"), ("never", "never gated")])
def test_promote_refuses_ungated_or_failed_versions(store, which, phrase):
    cfg, versions = store
    promote(cfg, versions["passed_a"])
    with pytest.raises(PromotionRefused, match=phrase.replace("(", r"\(")):
        promote(cfg, versions[which])
    assert alias_version_number(cfg) == versions["passed_a"]


def test_rollback_restores_previous_once(store):
    cfg, versions = store
    promote(cfg, versions["passed_a"])
    promote(cfg, versions["passed_b"])
    message = rollback(cfg)
    assert f"from version {versions['passed_b']} to version {versions['passed_a']}" in message
    assert alias_version_number(cfg) == versions["passed_a"]
    assert alias_version_number(cfg, "previous") is None
    with pytest.raises(RegistryError, match="no 'previous' alias"):
        rollback(cfg)


def test_resolve_missing_alias_and_version_explain_the_fix(store):
    cfg, _ = store
    with pytest.raises(RegistryError, match="draftline promote"):
        resolve_alias(cfg)
    with pytest.raises(RegistryError, match="no version 99"):
        promote(cfg, 99)


def test_cli_promote_and_rollback_exit_codes(store, capsys):
    from draftline.cli import main

    cfg, versions = store
    common = ["--config", "configs/tiny-cpu.yaml"] + [
        f"{key}={value}"
        for key, value in {
            "data_dir": cfg.data_dir,
            "tracking.tracking_uri": cfg.tracking.tracking_uri,
            "tracking.artifact_location": cfg.tracking.artifact_location,
            "tracking.registered_model": cfg.tracking.registered_model,
        }.items()
    ]
    assert main(["promote", "--version", versions["failed"], *common]) == 1
    assert "refusing to promote" in capsys.readouterr().err
    assert main(["promote", "--version", versions["passed_a"], *common]) == 0
    assert main(["rollback", *common]) == 1
    assert main(["promote", "--version", versions["passed_b"], *common]) == 0
    assert main(["rollback", *common]) == 0
    assert f"to version {versions['passed_a']}" in capsys.readouterr().out


def test_remote_source_is_downloaded_into_the_cache(store, tmp_path):
    from draftline.tracking import mlflow_client

    cfg, versions = store
    cfg = cfg.model_copy(deep=True)
    cfg.data_dir = str(tmp_path / "data")
    client = mlflow_client(cfg)
    local = client.get_model_version(cfg.registered_model_name, versions["passed_a"])
    remote = client.create_model_version(
        cfg.registered_model_name, source=f"runs:/{local.run_id}/drafter", run_id=local.run_id, tags={GATE_TAG: "passed"}
    )
    promote(cfg, remote.version)
    resolved = resolve_alias(cfg)
    assert resolved.export_dir.is_relative_to(tmp_path / "data" / "cache" / "models")
    assert load_drafter(resolved.export_dir).config.draft_vocab_size == 256
    assert resolve_alias(cfg).export_dir == resolved.export_dir  # cached


def _truncate_weights(export_dir):
    weights = export_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])


def _overwrite_weights_in_place(export_dir):
    weights = export_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4096:] = b"\xff" * 4096
    weights.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, phrase", [(_truncate_weights, "truncated"), (_overwrite_weights_in_place, "corrupt")])
def test_promote_refuses_a_version_whose_files_do_not_verify_and_moves_nothing(store, tiny_target_dir, damage, phrase,
                                                                               capsys):
    """Fault 2: the alias moved to a passed version with a truncated artifact; the next `draftline serve` failed."""
    from draftline.cli import main

    cfg, versions = store
    promote(cfg, versions["passed_a"])
    broken = register_drafter(cfg, random_drafter(tiny_target_dir, seed=5), {GATE_TAG: "passed"}, damage=damage)
    with pytest.raises(RegistryError, match=rf"version {broken}.*model.safetensors is {phrase}.*register a fresh export"):
        promote(cfg, broken)
    common = ["--config", "configs/tiny-cpu.yaml", f"data_dir={cfg.data_dir}",
              f"tracking.tracking_uri={cfg.tracking.tracking_uri}",
              f"tracking.artifact_location={cfg.tracking.artifact_location}",
              f"tracking.registered_model={cfg.tracking.registered_model}"]
    assert main(["promote", "--version", broken, *common]) == 1
    assert f"model.safetensors is {phrase}" in capsys.readouterr().err
    assert alias_version_number(cfg) == versions["passed_a"]
    assert alias_version_number(cfg, "previous") is None
    load_drafter(resolve_alias(cfg).export_dir)  # what `draftline serve` loads is still whole


def test_a_second_config_in_one_process_uses_its_own_store_not_the_first_ones(tmp_path, monkeypatch):
    """setup_mlflow points MLflow at a config's store without leaving MLFLOW_* in the environment: MLflow 3 writes
    them there, and MLFLOW_TRACKING_URI outranks a config's data_dir store, so the next config in the process (and
    every process it starts) would silently read and write the first one's runs (seen: a benchmark's online run
    logged into its offline run's store; a test read another's metrics)."""
    import os

    import mlflow

    from draftline.tracking import MLFLOW_ENVIRONMENT, setup_mlflow

    for name in MLFLOW_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    from conftest import make_test_config

    first, second = (make_test_config(tmp_path / name) for name in ("first", "second"))  # stores in their data_dirs
    assert first.tracking.tracking_uri is None
    setup_mlflow(first)
    assert mlflow.get_tracking_uri() == first.mlflow_tracking_uri  # MLflow itself is pointed at the first store
    assert [name for name in MLFLOW_ENVIRONMENT if name in os.environ] == []
    assert second.mlflow_tracking_uri != first.mlflow_tracking_uri
    assert second.mlflow_tracking_uri.endswith(f"{tmp_path / 'second'}/mlflow.db")
    # A user's own setting still wins, and is kept as it was.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'users.db'}")
    setup_mlflow(first)
    assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path / 'users.db'}"
    assert second.mlflow_tracking_uri == f"sqlite:///{tmp_path / 'users.db'}"

