"""Tiny random drafters for the drafter tests (no target bootstrap needed)."""

from __future__ import annotations

import torch

from draftline.drafter.model import DrafterConfig, Eagle3Drafter

TARGET_VOCAB = 40
DRAFT_VOCAB = 24


def tiny_config(**overrides) -> DrafterConfig:
    fields = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        draft_vocab_size=DRAFT_VOCAB,
        target_vocab_size=TARGET_VOCAB,
        target_hidden_size=32,
        aux_layer_ids=(1, 2, 3),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )
    fields.update(overrides)
    return DrafterConfig(**fields)


def random_vocab(config: DrafterConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-identity draft vocab: a random sorted subset of target ids, as offsets."""
    generator = torch.Generator().manual_seed(seed)
    target_ids = torch.randperm(config.target_vocab_size, generator=generator)[: config.draft_vocab_size].sort().values
    d2t = target_ids - torch.arange(config.draft_vocab_size)
    t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


def tiny_drafter(seed: int = 0, **overrides) -> Eagle3Drafter:
    return random_drafter(tiny_config(**overrides), seed)


def random_drafter(config: DrafterConfig, seed: int = 0) -> Eagle3Drafter:
    """Random weights of `config`'s shape (e.g. a twin's drafter: loader checks need no training)."""
    torch.manual_seed(seed)
    model = Eagle3Drafter(config)
    with torch.no_grad():
        # Random norm gains so a swapped or missing norm shows up in the comparisons.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.set_vocab(*random_vocab(model.config, seed))
    return model.eval()


def random_inputs(config: DrafterConfig, batch: int, length: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    input_embeds = torch.randn(batch, length, config.hidden_size, generator=generator)
    aux_hidden = torch.randn(batch, length, config.num_aux * config.target_hidden_size, generator=generator)
    target_logits = 3 * torch.randn(batch, length, config.target_vocab_size, generator=generator)
    return input_embeds, aux_hidden, target_logits
