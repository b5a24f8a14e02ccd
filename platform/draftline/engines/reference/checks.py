"""What the reference engine refuses, with the field and the fix: speculative configs, drafters, requests."""

from __future__ import annotations

from pathlib import Path

from draftline.config import SpeculativeConfig
from draftline.engines.base import SamplingParams
from draftline.target.aux_layers import capture_id_problems


def check_speculative(spec: SpeculativeConfig) -> None:
    if spec.algorithm.upper() != "EAGLE3":
        raise ValueError(
            f"engine.speculative.algorithm {spec.algorithm!r}: the reference engine implements EAGLE3 only "
            "(EAGLE-1/2 drafters read one hidden state, not three); set engine.speculative.algorithm=EAGLE3"
        )
    if spec.eagle_topk > 1 and spec.num_draft_tokens < 2:
        raise ValueError(
            f"engine.speculative.num_draft_tokens {spec.num_draft_tokens}: a tree (eagle_topk > 1) verifies the root "
            "plus at least one draft; set num_draft_tokens >= 2"
        )


def check_drafter_fits_target(drafter, model, drafter_dir: Path) -> None:
    config = drafter.config
    problems = []
    if config.target_hidden_size != model.config.hidden_size:
        problems.append(f"target_hidden_size {config.target_hidden_size} != target hidden_size {model.config.hidden_size}")
    if config.target_vocab_size != model.config.vocab_size:
        problems.append(f"vocab_size {config.target_vocab_size} != target vocab_size {model.config.vocab_size}")
    problems += capture_id_problems(config.aux_layer_ids, model.config.num_hidden_layers)
    if problems:
        raise ValueError(f"drafter {drafter_dir} was not trained for this target: " + "; ".join(problems))


def check_request(prompt_ids: list[int], params: SamplingParams, max_positions: int, vocab_size: int) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token")
    if len(prompt_ids) >= max_positions:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens; the target handles at most {max_positions - 1}")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise ValueError(f"prompt_ids hold ids outside the target vocabulary [0, {vocab_size})")
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.max_new_tokens < 1:
        raise ValueError(
            f"sampling params temperature={params.temperature} (>= 0), top_p={params.top_p} (in (0, 1]), "
            f"max_new_tokens={params.max_new_tokens} (>= 1)"
        )
