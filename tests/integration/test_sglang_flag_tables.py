"""Every committed per-release flag table (platform/draftline/engines/sglang/flags/) is regenerated identically from
that release's wheel by scripts/gen_sglang_flags.py. The wheels come from `make sglang` (scripts/setup_sglang_venv.sh
downloads every release that has a table), so this runs in the integration tier."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_script
from draftline.engines.sglang.args import FLAGS_DIR, available_flag_versions
from draftline.engines.sglang.real import sglang_root


def wheel_of(version: str) -> Path:
    wheels = sorted((sglang_root() / "wheels").glob(f"sglang-{version}-*.whl"))
    assert wheels, f"no SGLang {version} wheel under {sglang_root() / 'wheels'}: run `make sglang`"
    return wheels[0]


def test_generator_reproduces_every_committed_table(tmp_path):
    generator = load_script("scripts/gen_sglang_flags.py")
    versions = available_flag_versions()
    assert versions, f"no flag table under {FLAGS_DIR}"
    for version in versions:
        assert generator.main([str(wheel_of(version)), "--out-dir", str(tmp_path)]) == 0
        generated = json.loads((tmp_path / f"{version}.json").read_text())
        committed = json.loads((FLAGS_DIR / f"{version}.json").read_text())
        assert generated == committed, version
