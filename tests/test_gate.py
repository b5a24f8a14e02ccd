"""`draftline gate`: the decision rules on synthetic reports, and real gate runs that tag registered versions."""

from __future__ import annotations

import mlflow
import pytest

from draftline.config import GateConfig
from draftline.gate import decide, run_gate
from draftline.registry import PromotionRefused, promote
from draftline.tracking import GATE_REASONS_TAG, GATE_RUN_TAG, GATE_TAG, mlflow_client
from conftest import SMALL_BENCH
from registry_helpers import mlflow_test_config, random_drafter, register_drafter


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def row(label, concurrency=1, accept=3.0, speedup=1.4, lossless=True, itl_p99=10.0):
    return {"label": label, "concurrency": concurrency, "accept_length": accept, "speedup": speedup,
            "lossless": lossless, "itl_ms_p99": itl_p99}  # fmt: skip


def failed(checks):
    return {c.name for c in checks if not c.passed}


def test_decide_passes_a_good_candidate_without_champion():
    checks = decide(GateConfig(), {"rows": [row("target-only", accept=None), row("v2")]}, "v2", None)
    assert failed(checks) == set()
    assert any(c.name == "champion" and "no other champion" in c.detail for c in checks)


@pytest.mark.parametrize(
    "candidate, champion, expected",
    [
        (row("v2", accept=1.2), row("c"), {"accept_length", "champion"}),
        (row("v2", speedup=0.8), row("c"), {"speedup"}),
        (row("v2", lossless=False), row("c"), {"lossless"}),
        (row("v2", accept=3.0), row("c", accept=3.1), {"champion"}),
        (row("v2", itl_p99=20.0), row("c", itl_p99=10.0), {"p99_itl"}),
        (row("v2", itl_p99=14.0), row("c", itl_p99=10.0), set()),
    ],
)
def test_decide_each_rule(candidate, champion, expected):
    report = {"rows": [row("target-only", accept=None), candidate, {**champion, "label": "champion-v1"}]}
    assert failed(decide(GateConfig(), report, "v2", "champion-v1")) == expected


def test_decide_uses_the_worst_concurrency_level():
    report = {"rows": [row("v2", 1, speedup=1.5), row("v2", 4, speedup=0.9)]}
    assert failed(decide(GateConfig(), report, "v2", None)) == {"speedup"}


def test_champion_margin_and_lossless_switch():
    report = {"rows": [row("v2", accept=3.2, lossless=False), row("champion-v1", accept=3.0)]}
    gate = GateConfig(champion_margin=0.5, require_lossless=False)
    assert failed(decide(gate, report, "v2", "champion-v1")) == {"champion"}


@pytest.mark.slow
def test_gate_runs_tag_versions_and_drive_promotion(tmp_path, tiny_target_dir, fitted_drafter_dir):
    """A fitted drafter passes and is promoted; a random one fails (accept length) and promotion refuses it."""
    from draftline.drafter.export import load_drafter

    # min_speedup is relaxed: wall-clock speed on a shared test machine is not what this test is about.
    cfg = mlflow_test_config(tmp_path, SMALL_BENCH + ["bench.concurrency=[1]", "gate.min_speedup=0.2",
                                                       "gate.min_accept_len=1.5", "gate.max_p99_latency_ratio=100"])  # fmt: skip
    fitted = load_drafter(fitted_drafter_dir)
    good = register_drafter(cfg, fitted)
    bad = register_drafter(cfg, random_drafter(tiny_target_dir, 512, seed=5))

    decision = run_gate(cfg, good, log=lambda _: None)
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
