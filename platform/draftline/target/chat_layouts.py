"""Chat layouts an embedded target (or shape twin) can be built with: draftline's own and the published layouts of
Llama-3.1, Qwen3 (thinking), DeepSeek-V3 and Kimi-K2.

Each layout is a Jinja template in chat_templates/ (its header names the published file it follows and what it
leaves out) plus its tokens in chat_templates/layouts.json. A user's own target (target.kind=hf) needs none of
this: prepare, regenerate, bench and serving all use the chat template of the target's tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Optional

TEMPLATE_DIR = Path(__file__).parent / "chat_templates"


@dataclass(frozen=True)
class ChatLayout:
    name: str
    source: str  # the published model repository and file the template follows
    template: str
    bos_token: Optional[str]
    eos_token: str  # the token every reply ends with and generation stops at
    special_tokens: tuple[str, ...]
    added_tokens: tuple[str, ...]  # known to the tokenizer as one token each, but not special (Qwen3's <think>)


@cache
def _layouts() -> dict[str, dict]:
    entries = json.loads((TEMPLATE_DIR / "layouts.json").read_text())
    return {name: entry for name, entry in entries.items() if not name.startswith("_")}


def layout_names() -> list[str]:
    return list(_layouts())


def chat_layout(name: str) -> ChatLayout:
    entries = _layouts()
    if name not in entries:
        raise ValueError(f"chat layout {name!r} is not one of {', '.join(entries)} (target.embedded.chat_template)")
    entry = entries[name]
    return ChatLayout(
        name=name, source=entry["source"], template=(TEMPLATE_DIR / f"{name}.jinja").read_text(),
        bos_token=entry["bos_token"], eos_token=entry["eos_token"],
        special_tokens=tuple(entry["special_tokens"]), added_tokens=tuple(entry["added_tokens"]),
    )
