"""`draftline gate`: bench a candidate drafter version, decide pass/fail against `cfg.gate`, record it in MLflow.

The bench runs paired, interleaved rounds (bench/runner.py PairedRounds): the target alone, the candidate and the
champion take turns on the same prompts at every concurrency level, greedy. Timed checks use confidence intervals
(bench/stats.py: paired bootstrap over rounds and prompts); exact checks are counts and token comparisons:
  accept_length   exact: candidate accept length >= gate.min_accept_len at every concurrency level
  lossless        exact: every candidate output, every round, token-identical to the target's (gate.require_lossless)
  champion        exact: candidate accept length >= champion's + gate.champion_margin
  champion/seg    exact: the same within each prompt segment, when the bench has several (gate.champion_per_segment)
  speedup@c       timed: candidate vs target-only tokens/s at concurrency c against gate.min_speedup (per level)
  p99_itl@c       timed: candidate p99 inter-token latency / champion's at concurrency c <= gate.max_p99_latency_ratio
A timed check passes when its whole interval is on the good side of the threshold, fails when it is wholly on the
bad side, and is inconclusive otherwise. The gate looks after gate.min_rounds rounds; while no check failed and
some check is inconclusive it adds gate.rounds_per_look rounds and looks again, up to gate.max_rounds. Each look uses confidence
1 - (1 - gate.confidence) / looks (Bonferroni over the looks), so looking repeatedly does not inflate the error rate.
A check still inconclusive at the budget fails the gate (the candidate did not show it clears the bar) and says so.
The champion checks are skipped (and say so) when there is no champion or the candidate is the champion.

Recorded: an MLflow run (tags draftline.kind=gate, model_version, gate, gate_verdict) with the metrics, intervals,
rounds used and the machine load seen, and gate.json; on the version the tags gate=passed|failed, gate_reasons and
gate_run_id. `draftline promote` reads the `gate` tag.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from draftline.bench.run import plan_bench
from draftline.bench.runner import BASELINE, LoadRow, gap_cells
from draftline.bench.stats import percentile_ratio
from draftline.config import DraftlineConfig, GateConfig
from draftline.records import StageRecord
from draftline.registry import CHAMPION, RegistryError, get_version, latest_version, resolve_alias, trained_dataset_dir
from draftline.tracking import GATE_FAILED, GATE_PASSED, GATE_REASONS_TAG, GATE_RUN_TAG, GATE_TAG, mlflow_client

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass
class Check:
    name: str
    outcome: str  # PASS | FAIL | INCONCLUSIVE
    detail: str
    interval: Optional[list[float]] = None  # [low, high] for timed checks

    @property
    def passed(self) -> bool:
        return self.outcome == PASS


@dataclass
class GateDecision:
    version: str
    passed: bool
    checks: list[Check] = field(default_factory=list)
    champion_version: Optional[str] = None
    run_id: Optional[str] = None
    rounds: int = 0
    bench: dict = field(default_factory=dict, repr=False)  # the bench report the checks were made on

    @property
    def verdict(self) -> str:
        """passed | failed | inconclusive (failed because a timed check stayed inconclusive at the round budget)."""
        if self.passed:
            return "passed"
        return "failed" if any(c.outcome == FAIL for c in self.checks) else "inconclusive"

    def to_record(self) -> "GateRecord":
        """A compact summary for the pipeline's stage record and report (candidate at the lowest concurrency)."""
        rows = sorted(_rows(self.bench, f"v{self.version}"), key=lambda row: row["concurrency"]) if self.bench else []
        first = rows[0] if rows else {}
        baseline = next((r for r in self.bench.get("rows", []) if r["label"] == BASELINE
                         and r["concurrency"] == first.get("concurrency")), {})
        return GateRecord(
            version=self.version,
            passed=self.passed,
            verdict=self.verdict,
            reasons=[c.detail for c in self.checks if not c.passed],
            checks={c.name: c.passed for c in self.checks},
            intervals={c.name: c.interval for c in self.checks if c.interval is not None},
            rounds=self.rounds,
            machine_load=self.bench.get("machine_load"),
            run_id=self.run_id,
            champion_version=self.champion_version,
            bench=GateBench(
                concurrency=first.get("concurrency"),
                accept_length=first.get("accept_length"),
                speedup=first.get("speedup"),
                speedup_ci=first.get("speedup_ci"),
                cpu_speedup=first.get("cpu_speedup"),
                tokens_per_s=first.get("output_tokens_per_s"),
                baseline_tokens_per_s=baseline.get("output_tokens_per_s"),
                ttft_p50_ms=first.get("ttft_ms_p50"),
                itl_p50_ms=first.get("itl_ms_p50"),
                itl_p99_ms=first.get("itl_ms_p99"),
                lossless=all(r["lossless"] is True for r in rows) if rows else None,
                per_request_accept_lengths=first.get("per_request_accept_lengths", []),
                rows=[{k: v for k, v in r.items() if k != "per_request_accept_lengths"} for r in self.bench.get("rows", [])],
            ),
        )

    @property
    def reasons(self) -> str:
        failed = [c.detail for c in self.checks if not c.passed]
        return "; ".join(failed) if failed else "all checks passed"


@dataclass(frozen=True)
class GateBench:
    """The candidate's bench row at the lowest concurrency, and every row less the per-request accept lengths."""

    concurrency: Optional[int]
    accept_length: Optional[float]
    speedup: Optional[float]
    speedup_ci: Optional[list[float]]  # [low, high]
    cpu_speedup: Optional[float]
    tokens_per_s: Optional[float]
    baseline_tokens_per_s: Optional[float]
    ttft_p50_ms: Optional[float]
    itl_p50_ms: Optional[float]
    itl_p99_ms: Optional[float]
    lossless: Optional[bool]
    per_request_accept_lengths: list[float]
    rows: list[dict[str, Any]]


@dataclass(frozen=True)
class GateRecord(StageRecord):
    """The gate stage's output: the verdict on a version and the numbers it rests on."""

    STAGE = "gate"
    version: str
    passed: bool
    verdict: str  # passed | failed | inconclusive
    reasons: list[str]  # the details of the checks that did not pass
    checks: dict[str, bool]
    intervals: dict[str, list[float]]  # check -> [low, high], timed checks only
    rounds: int
    machine_load: Optional[dict[str, Any]]
    run_id: Optional[str]
    champion_version: Optional[str]
    bench: GateBench


def _rows(report: dict, label: str) -> list[dict]:
    return [row for row in report["rows"] if row["label"] == label]


def timed_outcome(low: float, high: float, threshold: float, higher_is_better: bool) -> str:
    """PASS when the interval clears the threshold, FAIL when it is wholly on the wrong side, else INCONCLUSIVE."""
    if higher_is_better:
        return PASS if low >= threshold else FAIL if high < threshold else INCONCLUSIVE
    return PASS if high <= threshold else FAIL if low > threshold else INCONCLUSIVE


def decide(gate: GateConfig, report: dict, candidate_label: str, champion_label: Optional[str]) -> list[Check]:
    """The gate's checks over a bench report (see module doc); pure, so it is tested on synthetic reports.

    Timed inputs: each candidate row's speedup and speedup_ci; report["champion_p99_itl"][str(c)] = {"estimate",
    "low", "high"} for the candidate/champion p99 ITL ratio at concurrency c (absent: nothing to compare).
    """
    candidate = sorted(_rows(report, candidate_label), key=lambda row: row["concurrency"])
    if not candidate:
        raise ValueError(f"bench report has no rows for {candidate_label!r}")
    accept = min(row["accept_length"] or 0.0 for row in candidate)
    checks = [Check("accept_length", PASS if accept >= gate.min_accept_len else FAIL,
                    f"accept length {accept:.2f} (lowest over concurrency levels) vs min {gate.min_accept_len}")]  # fmt: skip
    for row in candidate:
        level, threshold = row["concurrency"], gate.min_speedup_at(row["concurrency"])
        low, high = row["speedup_ci"]
        outcome = timed_outcome(low, high, threshold, higher_is_better=True)
        checks.append(Check(f"speedup@{level}", outcome, f"speedup at concurrency {level} {row['speedup']:.2f}x, "
                            f"interval [{low:.2f}, {high:.2f}] vs min {threshold}x: {outcome}", [low, high]))  # fmt: skip
    if gate.require_lossless:
        differing = [row["concurrency"] for row in candidate if row["lossless"] is not True]
        detail = "outputs token-identical to the target" if not differing else (
            f"outputs differ from the target's at concurrency {differing} (greedy must be lossless)"
        )
        checks.append(Check("lossless", FAIL if differing else PASS, detail))
    if champion_label is None:
        checks.append(Check("champion", PASS, "no other champion to compare with"))
        return checks
    champion_accept = min(row["accept_length"] or 0.0 for row in _rows(report, champion_label))
    checks.append(
        Check(
            "champion",
            PASS if accept >= champion_accept + gate.champion_margin else FAIL,
            f"accept length {accept:.2f} vs champion {champion_accept:.2f} + margin {gate.champion_margin}",
        )
    )
    if gate.champion_per_segment:
        checks += segment_champion_checks(gate, candidate, _rows(report, champion_label))
    for level, ratio in sorted(report.get("champion_p99_itl", {}).items(), key=lambda item: int(item[0])):
        outcome = timed_outcome(ratio["low"], ratio["high"], gate.max_p99_latency_ratio, higher_is_better=False)
        checks.append(Check(
            f"p99_itl@{level}", outcome,
            f"p99 ITL at concurrency {level} {ratio['estimate']:.2f}x the champion's, interval "
            f"[{ratio['low']:.2f}, {ratio['high']:.2f}] vs max {gate.max_p99_latency_ratio}x: {outcome}",
            [ratio["low"], ratio["high"]],
        ))  # fmt: skip
    return checks


def segment_champion_checks(gate: GateConfig, candidate: list[dict], champion: list[dict]) -> list[Check]:
    """The champion check within each prompt segment both measured (lowest over concurrency levels), when the bench
    has more than one: a candidate better overall may still be worse on one kind of prompt."""
    def by_segment(rows: list[dict]) -> dict[str, float]:
        lowest: dict[str, float] = {}
        for row in rows:
            for segment, measured in (row.get("accept_length_by_segment") or {}).items():
                if measured["accept_length"] is not None:
                    lowest[segment] = min(lowest.get(segment, measured["accept_length"]), measured["accept_length"])
        return lowest

    ours, theirs = by_segment(candidate), by_segment(champion)
    segments = sorted(set(ours) & set(theirs))
    if len(segments) < 2:
        return []
    return [Check(f"champion/{segment}", PASS if ours[segment] >= theirs[segment] + gate.champion_margin else FAIL,
                  f"accept length on {segment} prompts {ours[segment]:.2f} vs champion {theirs[segment]:.2f} + margin "
                  f"{gate.champion_margin}") for segment in segments]  # fmt: skip


def look_schedule(gate: GateConfig) -> list[int]:
    """Round counts at which the gate looks: min_rounds, then every rounds_per_look, and max_rounds last."""
    looks = list(range(gate.min_rounds, gate.max_rounds, gate.rounds_per_look)) + [gate.max_rounds]
    return sorted(set(looks))


async def sequential_checks(
    gate: GateConfig,
    run_round: Callable[[], Awaitable[None]],
    evaluate: Callable[[float], list[Check]],
    log=print,
) -> tuple[list[Check], int]:
    """Add rounds and look (`evaluate(confidence)`) until no check is inconclusive or the budget is spent.

    -> (checks of the last look, rounds run). A look where any check fails stops at once: more rounds cannot
    turn the verdict into a pass.
    """
    schedule = look_schedule(gate)
    per_look_confidence = 1 - (1 - gate.confidence) / len(schedule)
    rounds = 0
    checks: list[Check] = []
    for look_at in schedule:
        while rounds < look_at:
            await run_round()
            rounds += 1
        checks = evaluate(per_look_confidence)
        undecided = [c.name for c in checks if c.outcome == INCONCLUSIVE]
        failed = [c.name for c in checks if c.outcome == FAIL]
        log(f"[gate] look after {rounds} rounds (confidence {per_look_confidence:.4f}): "
            + ("; ".join(f"{c.name} {c.outcome}" for c in checks)))  # fmt: skip
        if not undecided or failed:
            break
    for check in checks:
        if check.outcome == INCONCLUSIVE:
            check.detail += f" after {rounds} rounds (gate.max_rounds {gate.max_rounds}): not shown to clear the threshold"
    return checks, rounds


def champion_p99_itl(rows: list[LoadRow], candidate_label: str, champion_label: str, confidence: float,
                     samples: int, seed: int) -> dict:  # fmt: skip
    """{str(concurrency): interval dict} of the candidate/champion p99 ITL ratio, paired over rounds and prompts."""
    by_key = {(row.label, row.concurrency): row for row in rows}
    out = {}
    for (label, level), row in by_key.items():
        if label != candidate_label:
            continue
        interval = percentile_ratio(gap_cells(row), gap_cells(by_key[(champion_label, level)]), 99, confidence, samples, seed)
        if interval is not None:
            out[str(level)] = interval.as_dict()
    return out


def gate_bench(cfg: DraftlineConfig, candidates, candidate_label: str, champion_label: Optional[str], log=print,
               dataset_dir: Optional[Path] = None):
    """The paired rounds of the gate with its looks -> (checks, rounds run, bench report of the last look)."""
    plan = plan_bench(cfg, candidates, sweep=False, temperature=0.0, dataset_dir=dataset_dir)
    report: dict = {}

    async def rounds():
        nonlocal report
        async with plan.paired_rounds(cfg, log) as paired:

            def evaluate(confidence: float) -> list[Check]:
                nonlocal report
                rows = paired.rows(confidence, cfg.bench.bootstrap_samples)
                report = plan.report(cfg, rows, confidence, paired.schedule())
                if champion_label is not None:
                    report["champion_p99_itl"] = champion_p99_itl(
                        rows, candidate_label, champion_label, confidence, cfg.bench.bootstrap_samples, cfg.seed
                    )
                return decide(cfg.gate, report, candidate_label, champion_label)

            return await sequential_checks(cfg.gate, paired.run_round, evaluate, log)

    checks, rounds_run = asyncio.run(rounds())
    return checks, rounds_run, report


def check_metric_name(check_name: str) -> str:
    """The MLflow metric of a check: `@` reads `_c`, and what MLflow refuses in a name (a client segment tag may hold
    `:`) becomes `_`."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", f"check_{check_name.replace('@', '_c')}")


def run_gate(cfg: DraftlineConfig, version: Optional[str] = None, log=print,
             dataset_dir: Optional[Path] = None) -> GateDecision:
    """Bench, decide and record the gate for `version` (default: the latest version of the registered model).

    Without bench.prompts the bench is the bench split of `dataset_dir`, default the dataset the candidate was
    trained on (draftline refresh gates on the original dataset's)."""
    import mlflow

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
    # The bench split of the dataset the candidate was trained on (prepare runs only when that one is gone).
    checks, rounds, report = gate_bench(
        cfg, candidates, candidate_label, champion_label, log, dataset_dir=dataset_dir or trained_dataset_dir(cfg, candidate)
    )
    decision = GateDecision(version, all(c.passed for c in checks), checks, champion.version if champion else None,
                            rounds=rounds, bench=report)  # fmt: skip

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
                "gate_verdict": decision.verdict,
            }
        )
        mlflow.log_params({f"gate.{key}": value for key, value in cfg.gate.model_dump().items()})
        for row in _rows(report, candidate_label):
            for key in ("output_tokens_per_s", "speedup", "accept_length", "itl_ms_p99", "ttft_ms_p99"):
                if row[key] is not None:
                    mlflow.log_metric(key, row[key], step=row["concurrency"])
            mlflow.log_metric("speedup_ci_low", row["speedup_ci"][0], step=row["concurrency"])
            mlflow.log_metric("speedup_ci_high", row["speedup_ci"][1], step=row["concurrency"])
        for check in checks:
            mlflow.log_metric(check_metric_name(check.name), float(check.passed))
        mlflow.log_metric("rounds", rounds)
        for key, value in report["machine_load"].items():
            mlflow.log_metric(f"machine_{key}", value)
        mlflow.log_dict({"decision": {k: v for k, v in asdict(decision).items() if k != "bench"},
                         "verdict": decision.verdict, "reasons": decision.reasons, "bench": report}, "gate.json")  # fmt: skip
    decision.run_id = run.info.run_id
    client.set_model_version_tag(name, version, GATE_TAG, outcome)
    client.set_model_version_tag(name, version, GATE_REASONS_TAG, decision.reasons)
    client.set_model_version_tag(name, version, GATE_RUN_TAG, run.info.run_id)
    return decision
