"""Regenerate's input and engine: prompt-only conversations are read and answered after every user turn; zero usable
conversations is a clear error; the pipeline keys the regenerate stage on regenerate.engine alone. No Ray, no engine
started. (That the replicas build regenerate.engine, a vLLM engine, needs `make setup-vllm`'s interpreter: it is in
tests/integration/test_regenerate.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_test_config
from draftline.data.conversations import NoConversationsError, read_conversations

PROMPTS = [
    {"prompt": "Write a haiku about tea."},
    {"question_id": 81, "category": "writing", "turns": ["Plan a trip to Hawaii.", "Now as a limerick."]},
    {"id": "user-only", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]},
]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_prompt_only_records_are_conversations_for_regenerate(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    good, bad = read_conversations(path, need_reply=False)
    assert bad == []
    by_id = {c.id: c.messages for c in good}
    assert by_id["prompts.jsonl:1"] == [{"role": "user", "content": "Write a haiku about tea."}]
    assert by_id["81"] == [{"role": "user", "content": "Plan a trip to Hawaii."},
                           {"role": "user", "content": "Now as a limerick."}]
    assert [m["role"] for m in by_id["user-only"]] == ["system", "user"]
    # prepare still needs a reply to learn from, and says how to get one
    good, bad = read_conversations(path)
    assert good == [] and {b.kind for b in bad} == {"no_assistant"}
    assert "regenerate.enabled=true" in str(bad[0])


def test_a_conversation_without_a_user_turn_prompts_nothing(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "system", "content": "s"}]}, {"turns": ["q", 3]}])
    good, bad = read_conversations(path, need_reply=False)
    assert good == [] and [(b.line, b.kind) for b in bad] == [(1, "no_user"), (2, "bad_field")]


def test_every_user_turn_gets_a_reply_slot():
    from draftline.regenerate.run import ReplySlot, reply_slots

    system, user, reply = {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}
    assert reply_slots([user]) == [user, ReplySlot()]
    assert reply_slots([system, user, reply, user]) == [system, user, ReplySlot(reply), user, ReplySlot()]
    assert reply_slots([user, user]) == [user, ReplySlot(), user, ReplySlot()]
    assert reply_slots([system, user, reply, user, reply]) == [system, user, ReplySlot(reply), user, ReplySlot(reply)]


@pytest.fixture
def fake_target_dir(tmp_path) -> Path:
    """A directory with the one file regenerate reads before it needs the model (its fingerprint's config.json)."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    return target


def test_zero_usable_conversations_is_a_clear_error(tmp_path, fake_target_dir):
    from draftline.regenerate.run import regenerate

    source = write_jsonl(tmp_path / "src.jsonl", ["{broken", {"messages": [{"role": "system", "content": "s"}]}])
    cfg = make_test_config(tmp_path / "data", [f"data.conversations={source}", "regenerate.enabled=true"])
    with pytest.raises(NoConversationsError, match=r"no usable conversation in .*src.jsonl: 2 record\(s\) read, "
                                                   r"dropped: malformed=1, no_user=1; first: .*src.jsonl:1: malformed"):
        regenerate(cfg, fake_target_dir)


def test_regenerate_stage_key_follows_its_own_engine(tmp_path):
    from draftline.pipeline import STAGES, stage_key

    regenerate_stage = next(s for s in STAGES if s.name == "regenerate")

    def key(*overrides: str) -> str:
        return stage_key(make_test_config(tmp_path, ["regenerate.enabled=true", *overrides]), regenerate_stage, {})

    own = ["regenerate.engine.backend=vllm"]
    # the gate's and serving's engine change nothing once regenerate has its own
    assert key(*own) == key(*own, "engine.backend=vllm") == key(*own, "engine.speculative.num_steps=5")
    assert key(*own) != key("regenerate.engine.backend=vllm", "regenerate.engine.vllm.enforce_eager=true")
    # by default regenerate runs the serving engine: its backend counts, its speculative settings do not
    assert key() != key("engine.backend=vllm")
    assert key() == key("engine.speculative.num_steps=5")
