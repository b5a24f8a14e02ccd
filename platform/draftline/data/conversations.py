"""Reading conversations: jsonl or parquet, OpenAI `messages`, ShareGPT `conversations` (from/value),
UltraChat `data` (a list of strings, user and assistant alternating, user first), or prompts: `turns` (user turns,
MT-bench's layout) or `prompt` (one user turn). Prompt-only conversations are regenerate's input (the target writes
the replies) and a bench's; prepare needs an assistant turn to learn from.
An assistant turn's `reasoning_content` (a reasoning target's thinking) is kept when it is a string.
Tool use (OpenAI `tools`, `tool_calls` and `tool` turns, ShareGPT `function_call`/`observation` turns) is read into
OpenAI's form by tool_turns.py; a malformed tool turn is a `tool_turn` bad input.

Every problem becomes a `BadInput` naming the file, the line (1-based; parquet: row + 1) and what to do;
nothing is silently dropped: the caller counts every one in the prepare report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Optional

from draftline.data.tool_turns import (
    SHAREGPT_CALL_ROLE,
    TOOL_RESULT_ROLES,
    ToolTurnError,
    assistant_calls,
    check_results_follow_calls,
    normalize_tools,
    tool_result,
)

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "chatgpt": "assistant", SHAREGPT_CALL_ROLE: "assistant"}


UTF8_BOM = b"\xef\xbb\xbf"


@dataclass
class BadRecord:
    """A line that could not be read as a JSON value, and why."""

    reason: str


@dataclass
class BadInput:
    file: str
    line: int
    kind: str  # malformed | unknown_role | no_assistant | no_user | bad_field | tool_turn | template | over_length
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.kind}: {self.message}"


@dataclass
class Conversation:
    id: str
    messages: list[dict]
    file: str
    line: int
    extra: dict = field(default_factory=dict)
    tools: Optional[list[dict]] = None  # OpenAI tool schemas the template renders (tool_turns.py)


class NoConversationsError(ValueError):
    """Nothing usable was read: a clear stop, with what was read and why each record was dropped."""

    def __init__(self, path: str | Path, records_read: int, problems: list[BadInput], fix: str):
        by_kind: dict[str, int] = {}
        for p in problems:
            by_kind[p.kind] = by_kind.get(p.kind, 0) + 1
        dropped = ", ".join(f"{k}={v}" for k, v in by_kind.items()) or "none"
        first = f"; first: {problems[0]}" if problems else ""
        super().__init__(f"no usable conversation in {path}: {records_read} record(s) read, dropped: {dropped}{first}; {fix}")


class DataError(ValueError):
    """Raised with policy `fail`: lists every bad input found."""

    def __init__(self, problems: list[BadInput]):
        shown = "\n".join(f"  {p}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(
            f"{len(problems)} bad input(s) with data.on_bad_input=fail:\n{shown}{more}\n"
            "Fix these lines, or set data.on_bad_input=skip to skip them (each is counted in report.json)."
        )
        self.problems = problems


def _records(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed record or the JSON error) for jsonl; (row + 1, record) for parquet."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, record in enumerate(pq.read_table(path).to_pylist()):
            yield i + 1, record
        return
    # Bytes, decoded per line: one line that is not UTF-8 is one bad input, not a codec error for the whole file.
    with open(path, "rb") as handle:
        for line_no, raw_bytes in enumerate(handle, start=1):
            if line_no == 1 and raw_bytes.startswith(UTF8_BOM):
                raw_bytes = raw_bytes[len(UTF8_BOM):]  # editors on Windows start files with a BOM
            if not raw_bytes.strip():
                continue
            try:
                raw = raw_bytes.decode("utf-8")
            except UnicodeDecodeError as err:
                yield line_no, BadRecord(f"not UTF-8 (byte {err.start + 1}: {raw_bytes[err.start:err.start + 1]!r}); "
                                         "re-encode the file as UTF-8")
                continue
            try:
                yield line_no, json.loads(raw)
            except json.JSONDecodeError as err:
                yield line_no, BadRecord(f"not valid JSON ({err.msg} at column {err.colno})")
            except RecursionError:
                yield line_no, BadRecord("nested too deeply to parse; a conversation is a list of turns, not a deep tree")


def _ultrachat_turns(record: dict) -> object:
    data = record.get("data")
    if not isinstance(data, list):
        return data
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(data)]


def _prompt_turns(record: dict) -> object:
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list):
            return turns
        return [{"role": "user", "content": text} for text in turns]
    return [{"role": "user", "content": record.get("prompt")}]


# auto: the first of these keys a record has picks its format.
FORMAT_KEYS = (("openai", "messages"), ("sharegpt", "conversations"), ("ultrachat", "data"), ("prompts", "turns"),
               ("prompts", "prompt"))


def _turns_of(record: dict, fmt: str) -> tuple[object, str, str, dict] | None:
    """(turns, role key, content key, role map) of a record in format `fmt` (auto: the first key it has)."""
    if fmt == "auto":
        fmt = next((f for f, key in FORMAT_KEYS if key in record), "")
    if fmt == "prompts":
        return _prompt_turns(record), "role", "content", {"user": "user"}
    if fmt == "ultrachat":
        return _ultrachat_turns(record), "role", "content", {"user": "user", "assistant": "assistant"}
    if fmt == "openai":
        return record.get("messages"), "role", "content", {r: r for r in ROLES}
    if fmt == "sharegpt":
        return record.get("conversations"), "from", "value", SHAREGPT_ROLES
    return None


def _normalize(record: dict, fmt: str, where: tuple[str, int], conv_id: str) -> tuple[list[dict], Optional[list]] | BadInput:
    """-> (messages, tools) or the record's first problem."""
    file, line = where
    read = _turns_of(record, fmt)
    if read is None:
        return BadInput(file, line, "bad_field", "no 'messages' (OpenAI), 'conversations' (ShareGPT), 'data' (UltraChat), "
                        "'turns' or 'prompt' field; add one of them")
    turns, role_key, content_key, role_map = read
    if not isinstance(turns, list) or not turns:
        return BadInput(file, line, "bad_field", f"field for {fmt} format must be a non-empty list of turns")
    try:
        tools = normalize_tools(record.get("tools"))
        messages, record_turns = [], []
        for i, turn in enumerate(turns):
            message = _message(turn, i, role_key, content_key, role_map)
            if isinstance(message, tuple):
                return BadInput(file, line, *message)
            messages.append(message)
            record_turns.append(i)
        check_results_follow_calls(messages, record_turns)
    except ToolTurnError as err:
        return BadInput(file, line, "tool_turn", f"conversation {conv_id!r} {err}")
    return messages, tools


def _message(turn: object, i: int, role_key: str, content_key: str, role_map: dict) -> dict | tuple[str, str]:
    """One turn in the form templates take, or (bad input kind, message). ToolTurnError: a malformed tool turn."""
    if not isinstance(turn, dict):
        return "bad_field", f"turn {i} is {type(turn).__name__}, expected an object with {role_key}/{content_key}"
    role = turn.get(role_key)
    if role in TOOL_RESULT_ROLES:
        return tool_result(turn, i, content_key)
    if role not in role_map:
        allowed = ", ".join(sorted(set(role_map) | set(TOOL_RESULT_ROLES)))
        return "unknown_role", f"turn {i} has {role_key}={role!r}; allowed: {allowed}"
    calls = assistant_calls(turn, i, content_key) if role_map[role] == "assistant" else None
    content = "" if role == SHAREGPT_CALL_ROLE or (calls and turn.get(content_key) is None) else turn.get(content_key)
    if not isinstance(content, str):
        return "bad_field", f"turn {i} {content_key} must be a string, got {type(content).__name__}"
    message = {"role": role_map[role], "content": content}
    if role_map[role] == "assistant" and isinstance(turn.get("reasoning_content"), str):
        message["reasoning_content"] = turn["reasoning_content"]
    if calls:
        message["tool_calls"] = calls
    return message


def _missing_turn(messages: list[dict], need_reply: bool, where: tuple[str, int]) -> BadInput | None:
    if not need_reply and not any(m["role"] == "user" for m in messages):
        return BadInput(*where, "no_user", "conversation has no user turn, so nothing prompts a reply; add one or remove it")
    if need_reply and not any(m["role"] == "assistant" for m in messages):
        return BadInput(*where, "no_assistant", "conversation has no assistant turn, so there is nothing to learn; "
                        "set regenerate.enabled=true to have the target answer it, or add a reply")
    return None


def read_conversations(
    path: str | Path, fmt: Literal["auto", "openai", "sharegpt", "ultrachat", "prompts"] = "auto",
    need_reply: bool = True,
) -> tuple[list[Conversation], list[BadInput]]:
    """need_reply=False: prompt-only conversations count (regenerate answers them, a bench prompts with them)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"conversations file {path} does not exist (data.conversations)")
    if path.is_dir():
        raise ValueError(f"data.conversations={path} is a directory; point it at one .jsonl or .parquet file inside it")
    if path.suffix not in {".jsonl", ".json", ".parquet"}:
        raise ValueError(f"conversations file {path}: expected .jsonl or .parquet (data.conversations)")
    good: list[Conversation] = []
    bad: list[BadInput] = []
    for line, record in _records(path):
        if isinstance(record, BadRecord):
            bad.append(BadInput(str(path), line, "malformed", record.reason))
            continue
        if not isinstance(record, dict):
            bad.append(BadInput(str(path), line, "malformed", f"expected a JSON object per line, got {type(record).__name__}"))
            continue
        given_id = record.get("id", record.get("question_id"))  # MT-bench numbers its questions
        conv_id = str(given_id) if given_id not in (None, "") else f"{path.name}:{line}"
        read = _normalize(record, fmt, (str(path), line), conv_id)
        if not isinstance(read, BadInput):
            read = _missing_turn(read[0], need_reply, (str(path), line)) or read
        if isinstance(read, BadInput):
            bad.append(read)
            continue
        messages, tools = read
        good.append(Conversation(id=conv_id, messages=messages, file=str(path), line=line, tools=tools))
    return good, bad


def drop_duplicate_ids(conversations: list[Conversation]) -> tuple[list[Conversation], list[BadInput]]:
    """Ids must be unique (splits and regenerated shards are keyed by id): later repeats become bad input."""
    kept: list[Conversation] = []
    problems: list[BadInput] = []
    seen: set[str] = set()
    for conv in conversations:
        if conv.id in seen:
            problems.append(BadInput(conv.file, conv.line, "bad_field", f"duplicate id {conv.id!r}; ids must be unique"))
            continue
        seen.add(conv.id)
        kept.append(conv)
    return kept, problems
