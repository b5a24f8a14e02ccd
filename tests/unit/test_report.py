"""The pipeline report's champion row says what the registry holds as the run ends (real MLflow store in tmp_path)."""

from __future__ import annotations

from draftline.tracking import GATE_TAG
from registry_helpers import mlflow_test_config, random_drafter, register_drafter


def champion_row(cfg, summary: dict, out_dir) -> str:
    from draftline.report import write_report

    rows = write_report(cfg, summary, out_dir).read_text().splitlines()
    (row,) = [line for line in rows if line.startswith("| champion |")]
    return row


def not_promoted(version: str) -> dict:
    """The summary of a run whose promote stage refused `version` (its gate failed)."""
    return {"promote": {"status": "ran", "seconds": 0.1, "outputs": {"promoted": False, "version": version}}}


def test_the_champion_row_names_the_registrys_champion_not_a_refused_version(tmp_path, tiny_target_dir):
    """Before: `champion | v1 (not promoted)` with no champion alias in the registry at all."""
    from draftline.registry import promote

    cfg = mlflow_test_config(tmp_path)
    refused = register_drafter(cfg, random_drafter(tiny_target_dir, seed=1), {GATE_TAG: "failed"})
    assert champion_row(cfg, not_promoted(refused), tmp_path) == (
        f"| champion | none (v{refused} not promoted: it failed the gate) |"
    )

    champion = register_drafter(cfg, random_drafter(tiny_target_dir, seed=2), {GATE_TAG: "passed"})
    promote(cfg, champion)
    refused_again = register_drafter(cfg, random_drafter(tiny_target_dir, seed=3), {GATE_TAG: "failed"})
    assert champion_row(cfg, not_promoted(refused_again), tmp_path) == (
        f"| champion | v{champion} (v{refused_again} not promoted: it failed the gate) |"
    )
    promoted = {"promote": {"status": "ran", "seconds": 0.1, "outputs": {"promoted": True, "version": champion}}}
    assert champion_row(cfg, promoted, tmp_path) == f"| champion | v{champion} |"
