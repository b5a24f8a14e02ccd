"""Draft vocabulary: the K most frequent loss-masked target tokens.

Tensors exactly as SGLang's EAGLE-3 loader reads them (srt/models/llama_eagle3.py, `d2t` / `t2d` weights):
- `d2t` int64 [K]: offsets, target_id = draft_id + d2t[draft_id]
- `t2d` bool [V]: True where a target token has a draft id
Draft ids are assigned in ascending target-id order, so both directions are monotone.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterable

import torch

from draftline.utils import atomic_write_bytes


class VocabError(ValueError):
    pass


def build_draft_vocab(masked_token_ids: Iterable[int], target_vocab_size: int, draft_vocab_size: int,
                      always_include: Iterable[int] = ()) -> tuple[torch.Tensor, torch.Tensor, dict]:
    if draft_vocab_size > target_vocab_size:
        raise VocabError(
            f"data.draft_vocab_size={draft_vocab_size} exceeds the target vocabulary ({target_vocab_size}); "
            f"set it to at most {target_vocab_size}"
        )
    counts = Counter(masked_token_ids)
    out_of_range = [t for t in counts if not 0 <= t < target_vocab_size]
    if out_of_range:
        raise VocabError(f"token ids {sorted(out_of_range)[:5]} are outside the target vocabulary of {target_vocab_size}")
    forced = list(dict.fromkeys(int(t) for t in always_include))
    # Most frequent first; ties broken by id for determinism.
    ranked = forced + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in set(forced)]
    chosen = ranked[:draft_vocab_size]
    # Fewer distinct tokens than K: fill with the lowest unused ids so the tensors keep the configured size.
    if len(chosen) < draft_vocab_size:
        used = set(chosen)
        chosen += [t for t in range(target_vocab_size) if t not in used][: draft_vocab_size - len(chosen)]
    target_ids = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = target_ids - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    total = sum(counts.values())
    covered = sum(counts[int(t)] for t in target_ids)
    stats = {
        "distinct_masked_tokens": len(counts),
        "masked_tokens": total,
        "coverage": covered / total if total else 0.0,
    }
    return d2t, t2d, stats


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft id per target id, -1 where the target token has none."""
    draft_index = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d[target_ids], draft_index[target_ids], torch.full_like(target_ids, -1))


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    from safetensors.torch import save

    atomic_write_bytes(path, save({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}))


def load_vocab_file(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return tensors["d2t"], tensors["t2d"]
