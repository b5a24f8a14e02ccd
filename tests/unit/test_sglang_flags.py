"""The per-release flag tables: one for every SGLang release from 0.5.6 on, each regenerated identically from its wheel.

The wheels come from `make sglang` (scripts/setup_sglang_venv.sh downloads every release that has a table).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from draftline.engines.sglang.args import FLAGS_DIR, available_flag_versions, flag_table_for
from draftline.engines.sglang.real import sglang_root
from draftline.engines.sglang.rules import VERSION_TABLE

REPO = Path(__file__).resolve().parents[2]
# Every release on PyPI from 0.5.6 to 0.5.23 (`pip index versions sglang`).
RELEASES = [
    "0.5.6", "0.5.6.post1", "0.5.6.post2", "0.5.7", "0.5.8", "0.5.8.post1", "0.5.9", "0.5.10", "0.5.10.post1",
    "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16",
    "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23",
]  # fmt: skip


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_sglang_flags", REPO / "scripts/gen_sglang_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wheel_of(version: str) -> Path:
    wheels = sorted((sglang_root() / "wheels").glob(f"sglang-{version}-*.whl"))
    assert wheels, f"no SGLang {version} wheel under {sglang_root() / 'wheels'}: run `make sglang`"
    return wheels[0]


def test_every_release_has_a_table_and_every_generation_a_rule_row():
    assert available_flag_versions() == RELEASES
    assert {row.checked_version for row in VERSION_TABLE} <= set(RELEASES)
    for version in RELEASES:
        assert flag_table_for(version).version == version


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


def test_generator_reproduces_every_committed_table(tmp_path):
    generator = load_generator()
    for version in RELEASES:
        assert generator.main([str(wheel_of(version)), "--out-dir", str(tmp_path)]) == 0
        generated = json.loads((tmp_path / f"{version}.json").read_text())
        committed = json.loads((FLAGS_DIR / f"{version}.json").read_text())
        assert generated == committed, version
