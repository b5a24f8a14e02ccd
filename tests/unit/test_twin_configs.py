"""Every production config has a shape twin (configs/twins/), and every one of them passes `draftline run --dry-run`."""

from __future__ import annotations

import pytest

from conftest import PRODUCTION, REPO, TWINS
from draftline.cli import main
from draftline.config import load_config

PRODUCTION_CONFIGS = {p.stem for p in (REPO / "configs").glob("*.yaml") if load_config(p).target.kind == "hf"}


def test_every_production_config_has_a_twin():
    missing = sorted(PRODUCTION_CONFIGS - set(TWINS))
    assert not missing, f"production configs without a shape twin in configs/twins/: {missing}"
    assert {"llama3.1-8b-4xgpu", "kimi-k2.5", "qwen3-8b"} <= PRODUCTION_CONFIGS
    assert set(TWINS) == set(PRODUCTION)


@pytest.mark.parametrize("config", sorted(PRODUCTION_CONFIGS) + [f"twins/{t}" for t in TWINS])
def test_dry_run_of_production_configs_and_their_twins(config, capsys):
    assert main(["run", "--config", str(REPO / "configs" / f"{config}.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(REPO / "configs" / f"{config}.yaml")
    # Twins are built here (bootstrap); a production config regenerates its data first when it says so.
    first = "bootstrap" if cfg.target.kind == "embedded" else "regenerate" if cfg.regenerate.enabled else "prepare"
    assert f"# stages: {first} -> " in out and out.rstrip().endswith("-> serve"), out[-2000:]
