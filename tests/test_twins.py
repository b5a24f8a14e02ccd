"""Shape twins (configs/twins/): every production config has one, and it and its twin pass `draftline run --dry-run`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from draftline.config import load_config

TWINS = sorted(p.stem for p in (REPO / "configs" / "twins").glob("*.yaml"))
PRODUCTION_CONFIGS = {p.stem for p in (REPO / "configs").glob("*.yaml") if load_config(p).target.kind == "hf"}


@pytest.mark.parametrize("config", sorted(PRODUCTION_CONFIGS) + [f"twins/{t}" for t in TWINS])
def test_dry_run_of_production_configs_and_their_twins(config):
    done = subprocess.run([sys.executable, "-m", "draftline.cli", "run", "--config", str(REPO / "configs" / f"{config}.yaml"),
                           "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "# stages: bootstrap" in done.stdout or "# stages: prepare" in done.stdout, done.stdout[-2000:]


def test_every_production_config_has_a_twin():
    missing = sorted(PRODUCTION_CONFIGS - set(TWINS))
    assert not missing, f"production configs without a shape twin in configs/twins/: {missing}"
    assert {"llama3.1-8b-4xgpu", "kimi-k2.5", "qwen3-8b"} <= PRODUCTION_CONFIGS
