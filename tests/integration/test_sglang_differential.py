"""Differential test: the rule table against SGLang's own argument code, one release per generation of that code.

Every command of `sglang_corpus.corpus` (>= 100: the seed's incident, each rule, each miss of issue 17, valid ones)
runs through SGLang's `prepare_server_args` / `resolve_once` / `check_server_args` in that release's interpreter
(`make sglang`) and through the rule table. A command "fails ServerArgs" for the rule table when it reports an error
of phase parse or server-args. Every disagreement must be listed, with its reason, in
tests/sglang_differential_expectations.yaml; a listed one that no longer happens fails too (the list stays true).
The same run checks that the release's flag table has exactly its parser's option strings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from draftline.engines.sglang.args import flag_table_for
from draftline.engines.sglang.preflight import preflight
from draftline.engines.sglang.real import find_installation, run_sglang_checks, sglang_root
from draftline.engines.sglang.rules import SERVER_ARGS_PHASES, VERSION_TABLE
from sglang_corpus import corpus, write_models

EXPECTATIONS = Path(__file__).parents[1] / "sglang_differential_expectations.yaml"
pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    target, draft = write_models(tmp_path_factory.mktemp("models"))
    return corpus(target, draft)


def test_corpus_covers_the_issue():
    cases = corpus(Path("/t"), Path("/d"))
    assert len(cases) >= 100
    ids = {case_id for case_id, _ in cases}
    for needed in ("seed-vllm-flag", "seed-draft-tokens-only", "flex-attention-eagle3", "pp2-eagle3", "dp-attention-standalone",
                   "dp-attention-ngram", "draft-path-missing", "adaptive-eagle3-topk2", "adaptive-ngram", "adaptive-steps-9",
                   "rejection-sampling-tree", "rejection-sampling-thresholds", "rejection-sampling-standalone",
                   "draft-sink-without-window", "dflash-block-0", "ngram-page16", "tree-capacity-exceeded"):  # fmt: skip
        assert needed in ids, needed


@pytest.mark.parametrize("version", [row.checked_version for row in VERSION_TABLE])
def test_rule_table_agrees_with_sglang(version, cases):
    installation = find_installation(version)
    assert installation is not None, f"SGLang {version} is not installed under {sglang_root()}: run `make sglang`"
    report = run_sglang_checks([argv for _, argv in cases], installation, flag_table_for(version))
    assert report.version == version
    # The committed flag table (generated from the wheel by ast) has exactly this release's parser's options.
    assert set(report.options) - {"-h", "--help"} == set(flag_table_for(version).flags)
    expected = yaml.safe_load(EXPECTATIONS.read_text()).get(version) or {}
    disagreements = {}
    for (case_id, argv), rejection in zip(cases, report.results):
        rule_errors = [f.rule for f in preflight(argv, version) if f.level == "error" and f.phase in SERVER_ARGS_PHASES]
        if bool(rule_errors) != (rejection is not None):
            disagreements[case_id] = (
                f"rules: {rule_errors or 'accepted'}; SGLang: "
                + (f"{rejection.phase} {rejection.type}: {rejection.message[:200]} at {rejection.where}" if rejection else "accepted")
            )
    unexplained = {case_id: why for case_id, why in disagreements.items() if case_id not in expected}
    stale = sorted(set(expected) - set(disagreements))
    assert not unexplained, f"SGLang {version}: disagreements not in {EXPECTATIONS.name}:\n" + "\n".join(f"{k}: {v}" for k, v in unexplained.items())
    assert not stale, f"SGLang {version}: listed in {EXPECTATIONS.name} but no longer disagreeing: {stale}"
