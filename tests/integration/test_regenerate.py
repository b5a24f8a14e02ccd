"""The regenerate stage: input formats, turn-by-turn regeneration with the reference engine, shards on a real local Ray
(resume after a rerun and after a replica process is killed), provenance checked by prepare. Test-size target."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import make_test_config
from draftline.data.conversations import read_conversations

MULTI_TURN = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What does `def join(a, *p)` in posixpath do?"},
    {"role": "assistant", "content": "an original reply that the target never wrote"},
    {"role": "user", "content": "What does `def split(p)` in posixpath do?"},
    {"role": "assistant", "content": "another original reply"},
]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_reads_sharegpt_ultrachat_openai_jsonl_and_parquet(tmp_path):
    records = [
        {"id": "sg", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"id": "uc", "data": ["q1", "a1", "q2", "a2"]},
        {"id": "oa", "messages": [{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": "a", "reasoning_content": "because"}]},
    ]
    from_jsonl, bad = read_conversations(write_jsonl(tmp_path / "all.jsonl", records))
    assert bad == []
    from_parquet = []
    for record in records:  # one parquet file per format, as people have them
        pq.write_table(pa.Table.from_pylist([record]), tmp_path / f"{record['id']}.parquet")
        from_parquet += read_conversations(tmp_path / f"{record['id']}.parquet")[0]
    for good in (from_jsonl, from_parquet):
        by_id = {c.id: c.messages for c in good}
        assert by_id["sg"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        assert [m["role"] for m in by_id["uc"]] == ["user", "assistant", "user", "assistant"]
        assert by_id["uc"][3]["content"] == "a2"
        assert by_id["oa"][1]["reasoning_content"] == "because"


def test_bad_input_is_counted_and_named(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"id": "ok", "data": ["q", "a"]},
        "{not json",
        {"id": "uc-bad", "data": ["q", 3]},
        {"id": "ok", "data": ["q", "a"]},
    ])
    good, bad = read_conversations(path, "auto")
    assert [c.id for c in good] == ["ok", "ok"]
    assert [(b.line, b.kind) for b in bad] == [(2, "malformed"), (3, "bad_field")]
    assert "bad.jsonl:3" in str(bad[1]) and "turn 1" in str(bad[1])


def test_split_reasoning():
    from draftline.target.reasoning import split_reasoning

    tags = ("<think>", "</think>")
    assert split_reasoning("<think> plan </think> answer", tags) == ("answer", "plan")
    assert split_reasoning("plan</think>answer", tags) == ("answer", "plan")  # start tag was in the prompt
    assert split_reasoning(" answer ", tags) == ("answer", None)
    assert split_reasoning("a</think>b", None) == ("a</think>b", None)


def test_stable_sample_is_stable_and_in_source_order():
    from draftline.data.conversations import Conversation
    from draftline.regenerate.run import stable_sample

    convs = [Conversation(str(i), [], "f", i) for i in range(50)]
    first = stable_sample(convs, 10)
    assert [c.id for c in first] == [c.id for c in stable_sample(list(reversed(convs)), 10)][::-1]
    assert [int(c.id) for c in first] == sorted(int(c.id) for c in first)
    assert len(first) == 10 and stable_sample(convs, 100) == convs


def test_turn_by_turn_on_regenerated_history(tiny_target_dir, one_torch_thread):
    """Each reply is the target's own greedy continuation of the history as regenerated so far."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftline.engines.reference.engine import ReferenceEngine
    from draftline.regenerate.run import regenerate_conversation, turn_settings

    cfg = make_test_config(extra=["regenerate.max_new_tokens_per_turn=24"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    engine = ReferenceEngine(cfg, tiny_target_dir)
    engine.load()
    record = asyncio.run(regenerate_conversation(engine, tokenizer, {"id": "c", "messages": MULTI_TURN},
                                                 turn_settings(cfg, tokenizer)))
    out = record["messages"]
    assert [m["role"] for m in out] == [m["role"] for m in MULTI_TURN]
    assert [m for m in out if m["role"] != "assistant"] == [m for m in MULTI_TURN if m["role"] != "assistant"]
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    for turn in (2, 4):
        text = tokenizer.apply_chat_template(out[:turn], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            greedy = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
        assert out[turn]["content"] == tokenizer.decode(greedy, skip_special_tokens=True).strip()
        assert out[turn]["content"] != MULTI_TURN[turn]["content"]
    assert record["regenerated"]["output_tokens"] > 0
    assert set(record["regenerated"]["finish_reasons"]) <= {"stop", "length"}


def test_prompt_only_conversation_is_answered_like_a_full_one(tiny_target_dir, one_torch_thread):
    """The same user turns without assistant turns: the target writes a reply after each, the ones it gives when it
    rewrites the full conversation."""
    from transformers import AutoTokenizer

    from draftline.engines.reference.engine import ReferenceEngine
    from draftline.regenerate.run import regenerate_conversation, turn_settings

    cfg = make_test_config(extra=["regenerate.max_new_tokens_per_turn=12"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    engine = ReferenceEngine(cfg, tiny_target_dir)
    engine.load()
    settings = turn_settings(cfg, tokenizer)
    prompts_only = [m for m in MULTI_TURN if m["role"] != "assistant"]
    full, answered = (asyncio.run(regenerate_conversation(engine, tokenizer, {"id": "c", "messages": messages}, settings))
                      for messages in (MULTI_TURN, prompts_only))
    assert [m["role"] for m in answered["messages"]] == [m["role"] for m in MULTI_TURN]
    assert answered["messages"] == full["messages"]


def _regen_config(tmp_path: Path, source: Path, extra: list[str]):
    return make_test_config(extra=[
        f"data.conversations={source}", "regenerate.enabled=true", "regenerate.max_new_tokens_per_turn=16",
        "regenerate.cpus_per_replica=1", *extra,
    ])


@pytest.fixture(scope="module")
def source_file(tmp_path_factory, tiny_target_dir):
    """The test target's own conversations, with one bad line and one too long for the target."""
    tmp = tmp_path_factory.mktemp("regen-source")
    lines = (tiny_target_dir / "conversations.jsonl").read_text().splitlines()[:40]
    too_long = {"id": "too-long", "messages": [{"role": "user", "content": "x " * 2000}, {"role": "assistant", "content": "a"}]}
    return write_jsonl(tmp / "source.jsonl", lines + ["{broken", json.dumps(too_long)])


def test_stage_shards_resume_and_provenance(ray_cluster, tmp_path, source_file, tiny_target_dir):
    from draftline.data.prepare import prepare
    from draftline.data.sources import ProvenanceError
    from draftline.regenerate.run import regenerate, stable_sample
    from draftline.target.load import target_fingerprint

    cfg = _regen_config(tmp_path, source_file, ["regenerate.limit=13", "regenerate.conversations_per_shard=4",
                                                "regenerate.num_replicas=2", f"data_dir={tmp_path / 'data'}"])
    with pytest.raises(FileNotFoundError, match="run `draftline regenerate`"):
        prepare(cfg, tiny_target_dir)
    first = regenerate(cfg, tiny_target_dir)
    manifest = json.loads((first.out_dir / "manifest.json").read_text())
    assert first.shards_total == 4 and first.shards_generated == 4
    assert manifest["target_fingerprint"] == target_fingerprint(tiny_target_dir)
    assert manifest["engine"]["backend"] == "reference"
    assert manifest["sampling"]["temperature"] == 0.0 and manifest["sampling"]["max_new_tokens_per_turn"] == 16
    assert manifest["source"]["sha256"] and manifest["source"]["selected"] == 13
    sampled = [c.id for c in stable_sample(read_conversations(source_file)[0], 13)]
    failed = int("too-long" in sampled)
    assert manifest["bad_input"]["by_kind"] == {"malformed": 1, **({"regenerate_failed": 1} if failed else {})}
    merged = [json.loads(line) for line in (first.out_dir / "conversations.jsonl").read_text().splitlines()]
    assert [r["id"] for r in merged] == [i for i in sampled if i != "too-long"]
    assert all(r["messages"][-1]["role"] == "assistant" for r in merged)

    again = regenerate(cfg, tiny_target_dir)
    assert again.shards_generated == 0 and again.out_dir == first.out_dir
    shard = first.out_dir / "shards" / "shard-00002.jsonl"
    before = shard.read_text()
    shard.write_text("truncated by a crash")  # sha256 no longer matches its .json: redone
    redone = regenerate(cfg, tiny_target_dir)
    assert redone.shards_generated == 1 and shard.read_text() == before

    dataset_dir = prepare(cfg, tiny_target_dir)
    assert json.loads((dataset_dir / "manifest.json").read_text())["conversations_sha256"] == manifest["conversations_sha256"]

    other = tmp_path / "other-target"
    shutil.copytree(first.out_dir, other)
    forged = json.loads((other / "manifest.json").read_text())
    forged["target_fingerprint"] = "0123456789abcdef"
    (other / "manifest.json").write_text(json.dumps(forged))
    plain = make_test_config(extra=[f"data.conversations={other / 'conversations.jsonl'}", f"data_dir={tmp_path / 'data'}"])
    with pytest.raises(ProvenanceError, match="regenerated by target 0123456789abcdef"):
        prepare(plain, tiny_target_dir)


def test_limit_and_failures_named(ray_cluster, tmp_path, source_file, tiny_target_dir):
    """The over-long conversation fails in the engine: named with file and line, the rest is regenerated."""
    from draftline.regenerate.run import regenerate

    cfg = _regen_config(tmp_path, source_file, ["regenerate.conversations_per_shard=50", f"data_dir={tmp_path / 'data'}",
                                                "regenerate.max_new_tokens_per_turn=4"])
    result = regenerate(cfg, tiny_target_dir)
    manifest = json.loads((result.out_dir / "manifest.json").read_text())
    assert manifest["bad_input"]["by_kind"] == {"malformed": 1, "regenerate_failed": 1}
    failed = [i for i in manifest["bad_input"]["items"] if "regenerate_failed" in i][0]
    assert f"{source_file}:42: regenerate_failed" in failed and "at most" in failed
    assert result.conversations == 40


def test_a_replica_ray_cannot_place_is_an_error_at_its_deadline_not_a_wait_forever(ray_cluster, tmp_path, source_file,
                                                                                   tiny_target_dir):
    """Seen in the suite (full13): a replica asking for 1 CPU on a Ray whose CPUs a served app held waited until the
    test's timeout, silently. Here the replica asks for one CPU more than the session's Ray has: never placed, whatever
    else runs beside it (an actor holding all but half a CPU was placed after all once another test's actors ended)."""
    import ray

    from draftline.regenerate.run import regenerate

    too_many = int(ray.cluster_resources()["CPU"]) + 1
    cfg = _regen_config(tmp_path, source_file, [f"data_dir={tmp_path / 'data'}", f"regenerate.cpus_per_replica={too_many}",
                                                "regenerate.replica_start_timeout_s=10"])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"replica\(s\) \[0\] did not start within regenerate.replica_start_timeout_s=10 s"
                                           rf": each asks for {too_many} CPU .* the Ray cluster has [\d.]+ of {too_many - 1} CPUs"):
        regenerate(cfg, tiny_target_dir)
    print(f"refused after {time.monotonic() - started:.1f} s")


def _replica_pids() -> list[int]:
    import ray
    from ray.util.state import list_actors

    alive = list_actors(address=ray.get_runtime_context().gcs_address,
                        filters=[("class_name", "=", "RegenerateReplica"), ("state", "=", "ALIVE")])
    return [a.pid for a in alive]


def test_killed_replica_resumes_without_losing_or_redoing(ray_cluster, tmp_path, source_file, tiny_target_dir):
    """SIGKILL the replica's process after its first shard: Ray restarts it, the shard it held is requeued."""
    from draftline.regenerate.run import regenerate, stable_sample

    cfg = _regen_config(tmp_path, source_file, ["regenerate.limit=30", "regenerate.conversations_per_shard=2",
                                                "regenerate.num_replicas=1", "regenerate.max_new_tokens_per_turn=24",
                                                f"data_dir={tmp_path / 'data'}"])
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=regenerate(cfg, tiny_target_dir)))
    runner.start()
    shards_dir = None
    # The first shard waits for the replica's start and its model load: 300 s was too little at load 30.
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and runner.is_alive():
        done = sorted((tmp_path / "data" / "regenerated").glob("*/shards/*.json"))
        if done:
            shards_dir = done[0].parent
            break
        time.sleep(0.05)
    assert shards_dir is not None, (f"no shard finished in 900 s; regenerate "
                                    f"{'still running' if runner.is_alive() else 'returned ' + repr(outcome)}")
    finished_before_kill = {p.name: p.stat().st_mtime_ns for p in shards_dir.glob("*.json")}
    pids = _replica_pids()
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    runner.join(timeout=600)
    result = outcome["result"]
    assert result.replica_deaths >= 1, "the kill landed after the last shard"
    expected = [c.id for c in stable_sample(read_conversations(source_file)[0], 30) if c.id != "too-long"]
    ids = [json.loads(line)["id"] for line in (result.out_dir / "conversations.jsonl").read_text().splitlines()]
    assert result.shards_total == 15 and ids == expected and result.conversations == len(expected)
    for name, mtime in finished_before_kill.items():
        assert (shards_dir / name).stat().st_mtime_ns == mtime, f"{name} was generated again"


def test_replicas_start_the_regenerate_engine_not_the_serving_one(tmp_path):
    """Built, not started: a vLLM engine needs `make setup-vllm`'s interpreter to be built."""
    from draftline.data.sources import engine_description
    from draftline.engines.reference.engine import ReferenceEngine
    from draftline.engines.vllm.engine import VLLMEngine
    from draftline.regenerate.run import build_engine

    fake_target_dir = tmp_path / "target"
    fake_target_dir.mkdir()
    (fake_target_dir / "config.json").write_text("{}")  # all regenerate reads before it needs the model

    cfg = make_test_config(tmp_path, ["regenerate.engine.backend=vllm", "regenerate.engine.vllm.enforce_eager=true",
                                      "regenerate.engine.vllm.cpu_threads=1", "engine.backend=reference"])
    engine = build_engine(cfg, fake_target_dir, 0)
    assert isinstance(engine, VLLMEngine) and engine.drafter_dir is None
    assert engine.cfg.engine.vllm.enforce_eager and engine.cfg.engine.vllm.cpu_threads == 1
    assert engine_description(cfg) == {"backend": "vllm", "device": "cpu"}
    serving_default = make_test_config(tmp_path, ["engine.backend=reference"])
    assert isinstance(build_engine(serving_default, fake_target_dir, 0), ReferenceEngine)
