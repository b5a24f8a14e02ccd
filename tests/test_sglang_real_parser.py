"""Optional: check generated and hand-written commands against SGLang's real argument parser.

Needs an interpreter with sglang installed: $DRAFTLINE_SGLANG_PYTHON, or .venv-sglang/ at the repo root
(create it with scripts/setup_sglang_venv.sh). Skipped with the reason when neither is there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from draftline.config import load_config
from draftline.engines.sglang.args import available_flag_versions, build_launch_argv, flag_table_for
from draftline.engines.sglang.preflight import preflight, real_parser_check_many, sglang_version_of

REPO = Path(__file__).resolve().parents[1]


def sglang_python() -> Path | None:
    configured = os.environ.get("DRAFTLINE_SGLANG_PYTHON")
    candidate = Path(configured) if configured else REPO / ".venv-sglang" / "bin" / "python"
    return candidate if candidate.exists() else None


PYTHON = sglang_python()
VERSION = sglang_version_of(PYTHON) if PYTHON else None
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        VERSION is None,
        reason="no interpreter with sglang: set DRAFTLINE_SGLANG_PYTHON or run scripts/setup_sglang_venv.sh "
        f"(looked for {os.environ.get('DRAFTLINE_SGLANG_PYTHON') or REPO / '.venv-sglang/bin/python'})",
    ),
]

LAUNCH = ["python", "-m", "sglang.launch_server", "--model-path", "org/target"]
SPEC = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "org/draft"]
ACCEPTED_BY_BOTH = [
    [*LAUNCH, *SPEC, "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
    [*LAUNCH, *SPEC, "--speculative-num-steps=5", "--speculative-eagle-topk=4", "--speculative-num-draft-tokens=8",
     "--page-size", "16", "--attention-backend", "flashinfer", "--lora-paths", "a", "b", "--port", "30001"],  # fmt: skip
]
REJECTED_BY_BOTH = [
    [*LAUNCH, *SPEC, "--num-speculative-tokens", "16"],
    [*LAUNCH, *SPEC, "--speculative-num", "3"],  # ambiguous abbreviation
    [*LAUNCH, "--attention-backend", "no-such-backend"],
    [*LAUNCH, "--page-size", "sixteen"],
]


@pytest.fixture(scope="module")
def report():
    cfg = load_config(None, [f"engine.sglang.version={VERSION}", "engine.sglang.mem_fraction_static=0.8", "engine.sglang.page_size=1"])
    generated = build_launch_argv(cfg, "org/target", "org/draft")
    argvs = [generated, *ACCEPTED_BY_BOTH, *REJECTED_BY_BOTH]
    return argvs, real_parser_check_many(argvs, PYTHON)


def rejected(result: dict) -> bool:
    return bool(result["unknown"] or result["error"])


def test_generated_command_is_accepted_by_sglang(report):
    argvs, real = report
    assert real["results"][0] == {"unknown": [], "error": None}, argvs[0]


def test_preflight_agrees_with_sglang_parser(report):
    argvs, real = report
    for argv, result in zip(argvs[1:], real["results"][1:]):
        ours = any(f.level == "error" for f in preflight(argv, VERSION))
        assert ours == rejected(result), (argv, result)


def test_flag_table_matches_sglang_parser_options(report):
    _, real = report
    if VERSION not in available_flag_versions():
        pytest.skip(f"installed sglang {VERSION} has no generated table; run scripts/gen_sglang_flags.py on its wheel")
    real_options = set(real["options"]) - {"-h", "--help"}
    assert real_options == set(flag_table_for(VERSION).flags)
