"""`draftline gate`: the decision rules on synthetic reports, and real gate runs that tag registered versions."""

from __future__ import annotations

import pytest

from draftline.config import GateConfig
from draftline.gate import (
    FAIL, INCONCLUSIVE, PASS, Check, GateDecision, check_metric_name, decide, look_schedule, sequential_checks, timed_outcome,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def row(label, concurrency=1, accept=3.0, speedup=(1.3, 1.5), lossless=True):
    """A bench row; speedup is its interval (low, high)."""
    low, high = speedup
    return {"label": label, "concurrency": concurrency, "accept_length": accept, "speedup": (low + high) / 2,
            "speedup_ci": [low, high], "lossless": lossless}  # fmt: skip


def itl(low, high):
    return {"estimate": (low + high) / 2, "low": low, "high": high}


def outcomes(checks):
    return {c.name: c.outcome for c in checks}


def failed(checks):
    return {c.name for c in checks if not c.passed}


def test_decide_passes_a_good_candidate_without_champion():
    checks = decide(GateConfig(), {"rows": [row("target-only", accept=None), row("v2")]}, "v2", None)
    assert failed(checks) == set()
    assert any(c.name == "champion" and "no other champion" in c.detail for c in checks)


@pytest.mark.parametrize(
    "candidate, champion, p99, expected",
    [
        (row("v2", accept=1.2), row("c"), None, {"accept_length": FAIL, "champion": FAIL}),
        (row("v2", speedup=(0.7, 0.9)), row("c"), None, {"speedup@1": FAIL}),
        (row("v2", speedup=(0.9, 1.2)), row("c"), None, {"speedup@1": INCONCLUSIVE}),
        (row("v2", lossless=False), row("c"), None, {"lossless": FAIL}),
        (row("v2", accept=3.0), row("c", accept=3.1), None, {"champion": FAIL}),
        (row("v2"), row("c"), itl(1.6, 2.0), {"p99_itl@1": FAIL}),
        (row("v2"), row("c"), itl(1.2, 1.7), {"p99_itl@1": INCONCLUSIVE}),
        (row("v2"), row("c"), itl(1.2, 1.4), {}),
    ],
)
def test_decide_each_rule(candidate, champion, p99, expected):
    report = {"rows": [row("target-only", accept=None), candidate, {**champion, "label": "champion-v1"}]}
    if p99 is not None:
        report["champion_p99_itl"] = {"1": p99}
    got = {name: outcome for name, outcome in outcomes(decide(GateConfig(), report, "v2", "champion-v1")).items()
           if outcome != PASS}  # fmt: skip
    assert got == expected


def test_decide_thresholds_per_concurrency_level():
    report = {"rows": [row("v2", 1, speedup=(1.4, 1.6)), row("v2", 4, speedup=(1.1, 1.2))]}
    assert failed(decide(GateConfig(), report, "v2", None)) == set()
    assert outcomes(decide(GateConfig(min_speedup=1.3), report, "v2", None))["speedup@4"] == FAIL
    per_level = GateConfig(min_speedup={1: 1.3, 4: 1.05})
    assert failed(decide(per_level, report, "v2", None)) == set()
    assert outcomes(decide(GateConfig(min_speedup={1: 1.3, 4: 1.15}), report, "v2", None))["speedup@4"] == INCONCLUSIVE


def test_unlisted_levels_use_the_next_lower_threshold():
    from draftline.config import load_config

    gate = load_config("configs/tiny-cpu.yaml", ["gate.min_speedup={1: 1.2, 4: 0.9}"]).gate
    assert [gate.min_speedup_at(c) for c in (1, 2, 4, 8)] == [1.2, 1.2, 0.9, 0.9]
    assert GateConfig(min_speedup={2: 1.1}).min_speedup_at(1) == 1.1  # below every listed level: the lowest one's
    assert GateConfig(min_speedup=1.3).min_speedup_at(16) == 1.3


def test_champion_margin_and_lossless_switch():
    report = {"rows": [row("v2", accept=3.2, lossless=False), row("champion-v1", accept=3.0)]}
    gate = GateConfig(champion_margin=0.5, require_lossless=False)
    assert failed(decide(gate, report, "v2", "champion-v1")) == {"champion"}


def test_timed_outcome_is_three_way():
    assert timed_outcome(1.1, 1.3, 1.0, higher_is_better=True) == PASS
    assert timed_outcome(0.8, 0.95, 1.0, higher_is_better=True) == FAIL
    assert timed_outcome(0.9, 1.1, 1.0, higher_is_better=True) == INCONCLUSIVE
    assert timed_outcome(1.1, 1.3, 1.5, higher_is_better=False) == PASS
    assert timed_outcome(1.6, 1.8, 1.5, higher_is_better=False) == FAIL


class ScriptedRounds:
    """A stand-in for the bench: each look sees the speedup interval the script gives for the rounds run so far."""

    def __init__(self, interval_after):
        self.interval_after, self.rounds, self.confidences = interval_after, 0, []

    async def run_round(self):
        self.rounds += 1

    def evaluate(self, gate):
        def look(confidence):
            self.confidences.append(confidence)
            return decide(gate, {"rows": [row("v2", speedup=self.interval_after(self.rounds))]}, "v2", None)

        return look


def run_sequential(gate, interval_after):
    import asyncio

    script = ScriptedRounds(interval_after)
    checks, rounds = asyncio.run(sequential_checks(gate, script.run_round, script.evaluate(gate), log=lambda _: None))
    return outcomes(checks), rounds, script


def test_inconclusive_adds_rounds_until_decided():
    gate = GateConfig(min_rounds=3, max_rounds=9, rounds_per_look=2)
    # the interval narrows with rounds: straddles 1.0 until 7 rounds, then clears it
    result, rounds, script = run_sequential(gate, lambda n: (0.95, 1.4) if n < 7 else (1.05, 1.3))
    assert result["speedup@1"] == PASS and rounds == 7
    assert look_schedule(gate) == [3, 5, 7, 9]
    assert script.confidences == [pytest.approx(1 - 0.05 / 4)] * 3  # Bonferroni over the 4 possible looks


def test_still_inconclusive_at_the_budget_fails_and_says_so():
    gate = GateConfig(min_rounds=2, max_rounds=4, rounds_per_look=1)
    result, rounds, _ = run_sequential(gate, lambda n: (0.9, 1.2))
    assert result["speedup@1"] == INCONCLUSIVE and rounds == 4
    decision = GateDecision("2", False, [Check("speedup@1", INCONCLUSIVE, "x", [0.9, 1.2])])
    assert decision.verdict == "inconclusive" and not decision.passed


def test_a_failed_check_stops_even_while_another_is_inconclusive():
    import asyncio

    gate = GateConfig(min_rounds=3, max_rounds=9, min_speedup={1: 1.0, 4: 1.0})
    rounds = 0

    async def run_round():
        nonlocal rounds
        rounds += 1

    def look(confidence):
        report = {"rows": [row("v2", 1, speedup=(0.9, 1.2)), row("v2", 4, speedup=(0.6, 0.8))]}
        return decide(gate, report, "v2", None)

    checks, used = asyncio.run(sequential_checks(gate, run_round, look, log=lambda _: None))
    assert used == 3 and outcomes(checks)["speedup@4"] == FAIL and outcomes(checks)["speedup@1"] == INCONCLUSIVE


def test_a_clear_result_stops_at_the_first_look():
    gate = GateConfig(min_rounds=3, max_rounds=9)
    assert run_sequential(gate, lambda n: (0.5, 0.7))[:2] == ({"speedup@1": FAIL, "accept_length": PASS,
                                                              "lossless": PASS, "champion": PASS}, 3)  # fmt: skip


def test_champion_per_segment_fails_a_candidate_better_overall_but_worse_on_one_segment():
    def segmented(label, plain, tools):
        return {**row(label, accept=(plain + tools) / 2), "accept_length_by_segment": {
            "plain": {"accept_length": plain, "prompts": 3}, "has-tools": {"accept_length": tools, "prompts": 2}}}

    report = {"rows": [segmented("v2", 3.6, 2.0), segmented("champion-v1", 2.4, 2.2)]}
    assert failed(decide(GateConfig(), report, "v2", "champion-v1")) == set()
    per_segment = decide(GateConfig(champion_per_segment=True), report, "v2", "champion-v1")
    assert failed(per_segment) == {"champion/has-tools"} and "champion/plain" in outcomes(per_segment)
    one_segment = {"rows": [{**row("v2"), "accept_length_by_segment": {"plain": {"accept_length": 3.0, "prompts": 4}}},
                            {**row("champion-v1"), "accept_length_by_segment": {"plain": {"accept_length": 2.0, "prompts": 4}}}]}
    assert "champion/plain" not in outcomes(decide(GateConfig(champion_per_segment=True), one_segment, "v2", "champion-v1"))


def test_check_metric_names_are_names_mlflow_takes():
    from mlflow.utils.validation import _validate_metric_name

    for name in ("speedup@4", "champion/has-tools", "champion/team:a.b-c_d"):
        _validate_metric_name(check_metric_name(name))
    assert check_metric_name("speedup@4") == "check_speedup_c4"
