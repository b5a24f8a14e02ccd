"""The engine protocol every backend implements (reference PyTorch, SGLang subprocess).

The same prompt set runs through every engine; the bench, the gate and the Serve deployment only talk to this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Protocol, runtime_checkable


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class SpecStats:
    """Speculative statistics, counted like SGLang's `meta_info` (accept length includes the bonus token)."""

    verify_steps: int = 0  # target forward passes that verified drafts (SGLang: spec_verify_ct)
    accepted_draft_tokens: int = 0  # draft tokens the target accepted (excludes the bonus token)
    output_tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify step, bonus token included (SGLang's spec accept length)."""
        return self.output_tokens / self.verify_steps if self.verify_steps else 0.0

    def merge(self, other: "SpecStats") -> "SpecStats":
        return SpecStats(
            self.verify_steps + other.verify_steps,
            self.accepted_draft_tokens + other.accepted_draft_tokens,
            self.output_tokens + other.output_tokens,
        )


@dataclass
class GenerationChunk:
    """One streamed piece: new token ids (and their text) since the previous chunk."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length"
    stats: Optional[SpecStats] = None  # cumulative for the request; set at least on the final chunk


# The model_version of an engine without a drafter (the target alone): served, benchmarked and reported as such.
TARGET_ONLY = "target-only"


@runtime_checkable
class Engine(Protocol):
    name: str
    model_version: str  # e.g. registry version of the drafter, or TARGET_ONLY

    async def start(self) -> None: ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        """Stream the completion of `prompt_ids`."""
        ...

    async def health(self) -> bool: ...

    async def stop(self) -> None: ...
