"""One request's decoding state; its target and drafter KV live in a row of the running caches (kv_cache.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftline.engines.base import SamplingParams, SpecStats


@dataclass
class Sequence:
    tokens: list[int]  # prompt + emitted
    prompt_length: int
    params: SamplingParams
    stop_ids: set[int]
    generator: torch.Generator  # the request's own, so a seeded request draws the same tokens at any concurrency
    pending_drafts: int = 0  # how many of the newest committed tokens are accepted drafts (the rest: bonus/prefill)
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0


def new_sequence(prompt_ids: list[int], params: SamplingParams, engine_stop_ids: set[int], device) -> Sequence:
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ())))
    return Sequence(list(prompt_ids), len(prompt_ids), params, engine_stop_ids | set(params.stop_token_ids), generator)
