"""`draftline gate`: bench a candidate drafter version, decide pass/fail against `cfg.gate`, record it in MLflow.

Checks (all on the bench prompts, greedy, in one bench run that also runs the target alone and the champion):
  accept_length   candidate accept length >= gate.min_accept_len            (lowest over concurrency levels)
  speedup         candidate tok/s / target-only tok/s >= gate.min_speedup   (lowest over concurrency levels)
  lossless        candidate outputs token-identical to the target's         (when gate.require_lossless)
  champion        candidate accept length >= champion's + gate.champion_margin
  p99_itl         candidate p99 inter-token latency <= champion's * gate.max_p99_latency_ratio (each level)
The champion checks are skipped (and say so) when there is no champion or the candidate is the champion.

Recorded: an MLflow run (tags draftline.kind=gate, model_version, gate) with the metrics and gate.json; on the
version the tags gate=passed|failed, gate_reasons and gate_run_id. `draftline promote` reads the `gate` tag.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

from draftline.bench.runner import BASELINE
from draftline.config import DraftlineConfig, GateConfig
from draftline.tracking import GATE_FAILED, GATE_PASSED, GATE_REASONS_TAG, GATE_RUN_TAG, GATE_TAG


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class GateDecision:
    version: str
    passed: bool
    checks: list[Check] = field(default_factory=list)
    champion_version: Optional[str] = None
    run_id: Optional[str] = None
    bench: dict = field(default_factory=dict, repr=False)  # the bench report the checks were made on

    def to_record(self) -> dict:
        """A compact summary for the pipeline's stage record and report (candidate at the lowest concurrency)."""
        rows = sorted(_rows(self.bench, f"v{self.version}"), key=lambda row: row["concurrency"]) if self.bench else []
        first = rows[0] if rows else {}
        baseline = next((r for r in self.bench.get("rows", []) if r["label"] == BASELINE
                         and r["concurrency"] == first.get("concurrency")), {})
        return {
            "version": self.version,
            "passed": self.passed,
            "reasons": [c.detail for c in self.checks if not c.passed],
            "checks": {c.name: c.passed for c in self.checks},
            "run_id": self.run_id,
            "champion_version": self.champion_version,
            "bench": {
                "concurrency": first.get("concurrency"),
                "accept_length": first.get("accept_length"),
                "speedup": first.get("speedup"),
                "cpu_speedup": first.get("cpu_speedup"),
                "tokens_per_s": first.get("output_tokens_per_s"),
                "baseline_tokens_per_s": baseline.get("output_tokens_per_s"),
                "ttft_p50_ms": first.get("ttft_ms_p50"),
                "itl_p50_ms": first.get("itl_ms_p50"),
                "itl_p99_ms": first.get("itl_ms_p99"),
                "lossless": all(r["lossless"] is True for r in rows) if rows else None,
                "per_request_accept_lengths": first.get("per_request_accept_lengths", []),
                "rows": [{k: v for k, v in r.items() if k != "per_request_accept_lengths"} for r in self.bench.get("rows", [])],
            },
        }

    @property
    def reasons(self) -> str:
        failed = [c.detail for c in self.checks if not c.passed]
        return "; ".join(failed) if failed else "all checks passed"


def _rows(report: dict, label: str) -> list[dict]:
    return [row for row in report["rows"] if row["label"] == label]


def _lowest(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if row[key] is not None]
    return min(values) if values else 0.0


def decide(gate: GateConfig, report: dict, candidate_label: str, champion_label: Optional[str]) -> list[Check]:
    """The gate's checks over a bench report (see module doc); pure, so it is tested on synthetic reports."""
    candidate = _rows(report, candidate_label)
    if not candidate:
        raise ValueError(f"bench report has no rows for {candidate_label!r}")
    accept = _lowest(candidate, "accept_length")
    speedup = _lowest(candidate, "speedup")
    checks = [
        Check("accept_length", accept >= gate.min_accept_len, f"accept length {accept:.2f} vs min {gate.min_accept_len}"),
        Check("speedup", speedup >= gate.min_speedup, f"speedup {speedup:.2f}x vs min {gate.min_speedup}x"),
    ]
    if gate.require_lossless:
        differing = [row["concurrency"] for row in candidate if row["lossless"] is not True]
        detail = "outputs token-identical to the target" if not differing else (
            f"outputs differ from the target's at concurrency {differing} (greedy must be lossless)"
        )
        checks.append(Check("lossless", not differing, detail))
    if champion_label is None:
        checks.append(Check("champion", True, "no other champion to compare with"))
        return checks
    champion = _rows(report, champion_label)
    champion_accept = _lowest(champion, "accept_length")
    checks.append(
        Check(
            "champion",
            accept >= champion_accept + gate.champion_margin,
            f"accept length {accept:.2f} vs champion {champion_accept:.2f} + margin {gate.champion_margin}",
        )
    )
    champion_itl = {row["concurrency"]: row["itl_ms_p99"] for row in champion}
    worst = None
    for row in candidate:
        base = champion_itl.get(row["concurrency"])
        if row["itl_ms_p99"] is None or not base:
            continue
        ratio = row["itl_ms_p99"] / base
        if worst is None or ratio > worst[0]:
            worst = (ratio, row["concurrency"])
    if worst is None:
        checks.append(Check("p99_itl", True, "no inter-token latencies to compare"))
    else:
        checks.append(
            Check(
                "p99_itl",
                worst[0] <= gate.max_p99_latency_ratio,
                f"p99 ITL {worst[0]:.2f}x the champion's at concurrency {worst[1]} vs max {gate.max_p99_latency_ratio}x",
            )
        )
    return checks


def run_gate(cfg: DraftlineConfig, version: Optional[str] = None, log=print) -> GateDecision:
    """Bench, decide and record the gate for `version` (default: the latest version of the registered model)."""
    import mlflow

    from draftline.bench.cli import run_bench
    from draftline.registry import CHAMPION, RegistryError, get_version, latest_version, resolve_alias
    from draftline.tracking import mlflow_client

    version = str(version or latest_version(cfg))
    candidate = get_version(cfg, version)
    try:
        champion = resolve_alias(cfg, CHAMPION)
    except RegistryError:
        champion = None
    if champion is not None and champion.version == version:
        champion = None
    candidate_label = f"v{version}"
    candidates = [(candidate_label, candidate.export_dir, version)]
    champion_label = None
    if champion is not None:
        champion_label = f"champion-v{champion.version}"
        candidates.append((champion_label, champion.export_dir, champion.version))
    log(f"[gate] {cfg.registered_model_name} version {version}" + (f" vs champion {champion.version}" if champion else ""))
    report = run_bench(cfg, candidates, sweep=False, temperature=0.0, log=log)
    checks = decide(cfg.gate, report, candidate_label, champion_label)
    decision = GateDecision(version, all(c.passed for c in checks), checks, champion.version if champion else None,
                            bench=report)

    client = mlflow_client(cfg)
    name = cfg.registered_model_name
    outcome = GATE_PASSED if decision.passed else GATE_FAILED
    with mlflow.start_run(run_name=f"gate-{name}-v{version}") as run:
        mlflow.set_tags(
            {
                "draftline.kind": "gate",
                "registered_model": name,
                "model_version": version,
                "champion_version": decision.champion_version or "",
                GATE_TAG: outcome,
            }
        )
        mlflow.log_params({f"gate.{key}": value for key, value in cfg.gate.model_dump().items()})
        for row in _rows(report, candidate_label):
            for key in ("output_tokens_per_s", "speedup", "accept_length", "itl_ms_p99", "ttft_ms_p99"):
                if row[key] is not None:
                    mlflow.log_metric(key, row[key], step=row["concurrency"])
        for check in checks:
            mlflow.log_metric(f"check_{check.name}", float(check.passed))
        mlflow.log_dict({"decision": {k: v for k, v in asdict(decision).items() if k != "bench"}, "reasons": decision.reasons,
                         "bench": report}, "gate.json")
    decision.run_id = run.info.run_id
    client.set_model_version_tag(name, version, GATE_TAG, outcome)
    client.set_model_version_tag(name, version, GATE_REASONS_TAG, decision.reasons)
    client.set_model_version_tag(name, version, GATE_RUN_TAG, run.info.run_id)
    return decision


def register(subparsers: argparse._SubParsersAction) -> None:
    from draftline.cli import add_config_args
    from draftline.engines import add_engine_arg

    parser = subparsers.add_parser(
        "gate", help="bench a drafter version and tag it gate=passed|failed", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--version", help="registered version to gate (default: the latest)")
    add_engine_arg(parser)
    add_config_args(parser)
    parser.set_defaults(func=_gate_command)


def _gate_command(args: argparse.Namespace) -> int:
    from draftline.cli import config_from_args
    from draftline.registry import RegistryError

    from draftline.engines import with_engine_arg

    cfg = with_engine_arg(config_from_args(args), args)
    try:
        decision = run_gate(cfg, args.version)
    except RegistryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for check in decision.checks:
        print(f"  [{'pass' if check.passed else 'FAIL'}] {check.name}: {check.detail}")
    verdict = "PASSED" if decision.passed else "FAILED"
    print(f"gate {verdict} for {cfg.registered_model_name} version {decision.version} (MLflow run {decision.run_id})")
    print(json.dumps({"version": decision.version, "gate": verdict.lower(), "reasons": decision.reasons}))
    return 0 if decision.passed else 1
