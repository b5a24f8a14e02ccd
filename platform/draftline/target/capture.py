"""What the EAGLE-3 drafter is fed: the ONE definition, shared by extraction (training data) and the reference engine.

aux_layer_ids are layer-OUTPUT ids (see draftline.target.aux_layers, the one place that maps them to what each
engine reads): the engines capture the residual stream entering layer i+1, the output of layer i, which HF returns
as `hidden_states[i + 1]` (`hidden_states[0]` is the embedding output). So aux layer id i selects `hidden_states[i + 1]`,
concatenated in layer order along the feature axis.

The drafter's token embedding is the target's embedding table as stored (`drafter_token_embedding`): the engines
hand the drafter `embed_tokens.weight` (SGLang's `get_embed_and_head`, vLLM's shared `embed_tokens`) and training
reads that tensor from the checkpoint, so a family's scale inside its embedding module (Gemma's sqrt(hidden)) is not
applied.

The final hidden state is the base model's `last_hidden_state`: the output of the final norm, the tensor the LM head
multiplies (`logits = lm_head(last_hidden_state)`), so training targets can be recomputed from it exactly.
"""

from __future__ import annotations

from typing import Sequence

import torch

from draftline.target.aux_layers import check_capture_ids


@torch.no_grad()
def capture_aux_hidden(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, aux_layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward -> (aux_hidden [B, T, n_aux*H], final_hidden [B, T, H]).

    `model` is an HF causal LM (e.g. LlamaForCausalLM). Only its base model runs: the LM head over the full target
    vocabulary is not needed here. Pad positions (attention_mask == 0) hold values the caller must drop.
    """
    base_model = model.base_model
    check_capture_ids(aux_layer_ids, base_model.config.num_hidden_layers)
    outputs = base_model(
        input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False, return_dict=True
    )
    aux_hidden = torch.cat([outputs.hidden_states[layer_id + 1] for layer_id in aux_layer_ids], dim=-1)
    return aux_hidden, outputs.last_hidden_state


def drafter_token_embedding(model) -> torch.nn.Embedding:
    """The target's token embedding as the drafter sees it: the stored table (shared, frozen), without the scale that
    HF's Gemma3TextScaledWordEmbedding multiplies into its output."""
    return torch.nn.Embedding.from_pretrained(model.get_input_embeddings().weight, freeze=True)
