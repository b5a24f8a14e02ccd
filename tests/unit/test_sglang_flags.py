"""The per-release flag tables: one for every SGLang release from 0.5.6 on, each with the speculative flags and a rule
row per generation. That each table is regenerated identically from its wheel needs `make sglang`'s wheels: that test
is tests/integration/test_sglang_flag_tables.py."""

from __future__ import annotations

import pytest

from draftline.engines.sglang.args import available_flag_versions, flag_table_for
from draftline.engines.sglang.rules import VERSION_TABLE

# Every release on PyPI from 0.5.6 to 0.5.23 (`pip index versions sglang`).
RELEASES = [
    "0.5.6", "0.5.6.post1", "0.5.6.post2", "0.5.7", "0.5.8", "0.5.8.post1", "0.5.9", "0.5.10", "0.5.10.post1",
    "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16",
    "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23",
]  # fmt: skip


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
