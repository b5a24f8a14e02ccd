"""The per-version flag tables: present, regenerated identically from the wheels, consistent with the rules."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from draftline.engines.sglang.args import FLAGS_DIR, available_flag_versions, flag_table_for
from draftline.engines.sglang.rules import VERSION_TABLE

REPO = Path(__file__).resolve().parents[1]
WHEEL_ROOT = Path("/tmp/sgl")


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_sglang_flags", REPO / "scripts/gen_sglang_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_checked_version_has_a_table():
    assert [row.checked_version for row in VERSION_TABLE] == available_flag_versions()


@pytest.mark.parametrize("version", [row.checked_version for row in VERSION_TABLE])
def test_table_has_the_speculative_flags(version):
    flags = flag_table_for(version).flags
    for option in ("--model-path", "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
                   "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--page-size", "--attention-backend"):  # fmt: skip
        assert option in flags, option
    assert flags["--speculative-num-steps"].type == "int" and flags["--speculative-num-steps"].nargs == 1
    assert flags["--trust-remote-code"].nargs == 0
    assert flags["--speculative-draft-model"].dest == "speculative_draft_model_path"  # alias
    assert flags["--model-path"].required


@pytest.mark.parametrize("version", [row.checked_version for row in VERSION_TABLE])
def test_generator_reproduces_committed_table(version, tmp_path):
    wheels = sorted((WHEEL_ROOT / version).glob("sglang-*.whl"))
    if not wheels:
        pytest.skip(f"no SGLang {version} wheel under {WHEEL_ROOT / version}")
    generator = load_generator()
    assert generator.main([str(wheels[0]), "--out-dir", str(tmp_path)]) == 0
    generated = json.loads((tmp_path / f"{version}.json").read_text())
    committed = json.loads((FLAGS_DIR / f"{version}.json").read_text())
    assert generated == committed
