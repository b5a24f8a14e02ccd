"""What the EAGLE-3 drafter is fed: the ONE definition, shared by extraction (training data) and the reference engine.

SGLang (srt/models/llama.py, `set_eagle3_layers_to_capture`, checked in 0.5.6, 0.5.12, 0.5.23) captures the residual
stream entering layers `[id + 1 for id in aux_layer_ids]` (default [2, n//2, n-3]), in layer order, and concatenates
them along the feature axis. The residual entering layer i+1 is the output of layer i, which HF returns as
`hidden_states[i + 1]` (`hidden_states[0]` is the embedding output). So aux layer id i selects `hidden_states[i + 1]`.

The final hidden state is the base model's `last_hidden_state`: the output of the final norm, the tensor the LM head
multiplies (`logits = lm_head(last_hidden_state)`), so training targets can be recomputed from it exactly.
"""

from __future__ import annotations

from typing import Sequence

import torch


def check_aux_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> None:
    """Refuse ids SGLang would capture differently from what we train on."""
    ids = list(aux_layer_ids)
    if not ids:
        raise ValueError("aux_layer_ids is empty: EAGLE-3 needs at least one captured layer")
    # SGLang captures the input of layer id+1, so the last layer's output (id n-1) is never captured there.
    out_of_range = [i for i in ids if not 0 <= i <= num_layers - 2]
    if out_of_range:
        raise ValueError(
            f"aux_layer_ids {ids}: ids {out_of_range} are outside 0..{num_layers - 2} for a {num_layers}-layer target "
            "(SGLang captures the input of layer id+1, which must exist); fix extract.aux_layer_ids"
        )
    # SGLang appends captures while walking the layers, so its feature order is ascending layer order.
    if ids != sorted(set(ids)):
        raise ValueError(
            f"aux_layer_ids {ids}: must be strictly ascending and distinct, because SGLang concatenates the captured "
            f"states in layer order; use {sorted(set(ids))}"
        )


@torch.no_grad()
def capture_aux_hidden(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, aux_layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward -> (aux_hidden [B, T, n_aux*H], final_hidden [B, T, H]).

    `model` is an HF causal LM (e.g. LlamaForCausalLM). Only its base model runs: the LM head over the full target
    vocabulary is not needed here. Pad positions (attention_mask == 0) hold values the caller must drop.
    """
    base_model = model.base_model
    check_aux_layer_ids(aux_layer_ids, base_model.config.num_hidden_layers)
    outputs = base_model(
        input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False, return_dict=True
    )
    aux_hidden = torch.cat([outputs.hidden_states[layer_id + 1] for layer_id in aux_layer_ids], dim=-1)
    return aux_hidden, outputs.last_hidden_state
