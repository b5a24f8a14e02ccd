"""vLLM's CPU build (.venv-vllm, `make setup-vllm`) serving the test target and a registered drafter version, for real.

The conftest's fitted drafter is registered in a test-local MLflow store the way the train stage registers its export
(`tracking.register_export`), and everything goes through `draftline bench --engine vllm --version N` (tests/
vllm_helpers.py), so vLLM serves the version's files as the registry hands them out, greedy on the bench prompts:
vLLM with the drafter is token-identical to vLLM alone, vLLM logs the version's aux ids, and its accept length (from
its own counters: output tokens / drafts) is within 3% of `draftline bench --version N` with the reference engine on
the same prompts. The 3% check catches the aux-id off-by-one (the SGLang ids as vLLM's top-level key moved vLLM's
accept length by -5.4% on these prompts: benchmarks/RESULTS.md). Two vLLM start-ups, so marked slow.
"""

from __future__ import annotations

import pytest

from conftest import TEST_CONFIG, config_overrides
from vllm_helpers import (
    check_accept_length_gap, check_logged_aux_ids, check_vllm_with_the_drafter_is_lossless, reference_bench,
    register_fitted, vllm_bench,
)  # fmt: skip

pytestmark = pytest.mark.slow

# The config's bench prompts: at test size the bench split has 19, each answered in about 8 tokens, a second or two
# per load. Fewer would not do: 8 of them make about 23 drafts, where one draft more or less moves the accept length
# by 4%, more than the 3% being checked.


@pytest.fixture(scope="module")
def registered(tmp_path_factory, tiny_target_dir, fitted_drafter_dir):
    return register_fitted(TEST_CONFIG, config_overrides(), tmp_path_factory.mktemp("mlflow"), fitted_drafter_dir)


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory, registered):
    return vllm_bench(tmp_path_factory.mktemp("vllm"), registered)


@pytest.fixture(scope="module")
def reference_report(tmp_path_factory, registered):
    return reference_bench(tmp_path_factory.mktemp("reference"), registered)


def test_vllm_with_the_drafter_is_token_identical_to_vllm_alone(vllm_run, registered):
    check_vllm_with_the_drafter_is_lossless(vllm_run[0], registered)


def test_vllm_reads_the_exports_top_level_aux_ids(vllm_run, registered):
    check_logged_aux_ids(vllm_run[1], registered)


def test_vllm_accept_length_is_within_3_percent_of_the_reference_engines(vllm_run, reference_report, registered):
    check_accept_length_gap(vllm_run[0], reference_report, registered)
