"""benchmarks/real_target.py's point data: one val set for every point, also while regenerate adds conversations."""

from __future__ import annotations

from conftest import load_script
from draftline.config import load_config
from draftline.utils import split_of


def _script():
    return load_script("benchmarks/real_target.py")


def _records(prefix: str, count: int) -> list[dict]:
    return [{"id": f"{prefix}{i}", "messages": [], "regenerated": {"output_tokens": 100}} for i in range(count)]


def test_val_from_keeps_the_first_pools_val_set_and_trains_on_none_of_the_new_val_split():
    script = _script()
    cfg = load_config(script.CONFIG)
    split = cfg.data.split
    first, added = _records("a", 200), _records("b", 200)

    def is_val(record: dict) -> bool:
        return split_of(record["id"], split.val_fraction, split.bench_fraction) != "train"

    first_val = [r["id"] for r in first if is_val(r)]
    assert first_val and any(is_val(r) for r in added)

    chosen = script.subset(first + added, 30_000, cfg, val_records=first)
    assert [r["id"] for r in chosen if is_val(r)] == first_val
    assert len(chosen) - len(first_val) == 300  # 30K reply tokens of 100 each, all from the train split
    assert not any(is_val(r) for r in chosen[len(first_val):])
    assert [r["id"] for r in script.subset(first, 0, cfg)] == first_val
