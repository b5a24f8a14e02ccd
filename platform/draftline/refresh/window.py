"""From captured traffic to a refresh's training data: dedupe, a time-ordered held-out slice, replay of the original.

Served completions are the target's own output (serving is lossless), so a captured chat request with its
completion is a regenerated conversation. `traffic_window` turns the store's records into conversations, keeps one
per distinct prompt (the newest), takes the newest `refresh.max_records`, and holds out the newest
`refresh.held_out_fraction` of them: the refresh is gated on requests that came after everything it trained on.
`replay_sample` picks the original dataset's train conversations mixed in (`refresh.replay_ratio`), by a seeded hash,
so the same window and seed give the same mix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Optional

from draftline.config import RefreshConfig
from draftline.utils import stable_hash


@dataclass(frozen=True)
class TrafficConversation:
    id: str
    time_s: float
    messages: list[dict]  # the request's messages and the served completion as the last (assistant) turn
    segment: Optional[str]  # the client's segment tag
    model_version: Optional[str]  # the version that answered
    prompt_token_ids: list[int]  # the prompt as served: rendered by the target's chat template, tokenized

    def as_conversation(self) -> dict:
        """One line of an `openai` conversations file (data/conversations.py)."""
        return {"id": self.id, "messages": self.messages}

    def as_bench_sample(self) -> dict:
        """One line of a bench split (bench/prompts.py): the prompt as it was served, under the client's segment."""
        sample = {"id": self.id, "input_ids": self.prompt_token_ids, "loss_mask": [0] * len(self.prompt_token_ids),
                  "messages": self.messages[:-1]}
        return {**sample, "segment": self.segment} if self.segment else sample


@dataclass
class TrafficWindow:
    """What a refresh trains and gates on, and the provenance every refreshed version records."""

    train: list[TrafficConversation]
    held_out: list[TrafficConversation]
    records_read: int
    skipped: dict[str, int] = field(default_factory=dict)  # why -> records not usable (completions route, no reply)
    duplicates: int = 0

    @property
    def used(self) -> list[TrafficConversation]:
        return self.train + self.held_out

    def provenance(self) -> dict[str, str]:
        """MLflow tags of a refreshed version: which traffic it saw (times are Unix seconds, UTC)."""
        segments = sorted({c.segment for c in self.used if c.segment})
        return {
            "refresh.traffic_from_s": f"{self.used[0].time_s:.3f}",
            "refresh.traffic_to_s": f"{self.used[-1].time_s:.3f}",
            "refresh.held_out_from_s": f"{self.held_out[0].time_s:.3f}",
            "refresh.traffic_train_requests": str(len(self.train)),
            "refresh.traffic_held_out_requests": str(len(self.held_out)),
            "refresh.traffic_records_read": str(self.records_read),
            "refresh.traffic_duplicates": str(self.duplicates),
            "refresh.traffic_segments": ",".join(segments),
            "refresh.traffic_window_hash": self.window_hash(),
        }

    def window_hash(self) -> str:
        return stable_hash([(c.id, c.time_s) for c in self.used])[:16]


def conversation_of(record: dict) -> tuple[Optional[TrafficConversation], Optional[str]]:
    """(the conversation of a captured chat request, None) or (None, why it cannot be trained on)."""
    if record.get("route") != "chat" or not isinstance(record.get("messages"), list):
        # A completions prompt is raw text the chat template never rendered: not a conversation to train on.
        return None, "completions route"
    reply = record.get("completion_text")
    if not isinstance(reply, str) or not reply:
        return None, "empty completion"
    if not isinstance(record.get("prompt_token_ids"), list) or not record["prompt_token_ids"]:
        return None, "no prompt tokens"
    messages = [dict(m) for m in record["messages"]] + [{"role": "assistant", "content": reply}]
    return TrafficConversation(
        id=f"traffic-{record['id']}", time_s=float(record["time_s"]), messages=messages,
        segment=record.get("segment"), model_version=record.get("model_version"),
        prompt_token_ids=[int(t) for t in record["prompt_token_ids"]],
    ), None


def dedupe_newest(conversations: Iterable[TrafficConversation]) -> tuple[list[TrafficConversation], int]:
    """One conversation per distinct prompt (its messages before the reply), the newest; -> (oldest first, dropped).

    A prompt asked again is then never both trained on and held out."""
    newest: dict[str, TrafficConversation] = {}
    count = 0
    for conv in conversations:
        count += 1
        key = json.dumps(conv.messages[:-1], sort_keys=True)
        if key not in newest or (conv.time_s, conv.id) > (newest[key].time_s, newest[key].id):
            newest[key] = conv
    kept = sorted(newest.values(), key=lambda c: (c.time_s, c.id))
    return kept, count - len(kept)


def traffic_window(records: Iterable[dict], refresh: RefreshConfig) -> TrafficWindow:
    """The window of the newest distinct chat requests, split into train and the newest held out (see module doc)."""
    usable, skipped, read = [], {}, 0
    for record in records:
        read += 1
        conv, why = conversation_of(record)
        if conv is None:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            usable.append(conv)
    distinct, duplicates = dedupe_newest(usable)
    if refresh.max_records is not None:
        distinct = distinct[-refresh.max_records:]
    held_out_count = int(len(distinct) * refresh.held_out_fraction)
    split = len(distinct) - held_out_count
    return TrafficWindow(distinct[:split], distinct[split:], read, skipped, duplicates)


def replay_sample(conversations: list[dict], count: int, seed: int) -> list[dict]:
    """`count` of the original train conversations (all when fewer), chosen by a seeded hash of their ids."""
    ranked = sorted(conversations, key=lambda conv: stable_hash(seed, conv["id"]))
    return ranked[:count]
