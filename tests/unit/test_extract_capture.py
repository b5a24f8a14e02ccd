"""capture_aux_hidden takes exactly what SGLang feeds the EAGLE-3 drafter, and batching does not change it."""

from __future__ import annotations

import pytest
import torch

from draftline.data.prepare import load_split
from draftline.extract.worker import hidden_states_for_samples
from draftline.target.aux_layers import check_capture_ids
from draftline.target.capture import capture_aux_hidden
from draftline.target.load import default_aux_layer_ids, load_target


@pytest.fixture(scope="module")
def target(tiny_cfg, tiny_target_dir):
    return load_target(tiny_cfg, target_dir=tiny_target_dir)


@pytest.fixture(scope="module")
def val_sequences(tiny_dataset_dir):
    samples = load_split(tiny_dataset_dir, "val")[:6]
    return [torch.tensor(s["input_ids"], dtype=torch.int64) for s in samples]


def _layer_inputs_by_hooks(model, layer_indices, input_ids, attention_mask):
    """Independent of HF's hidden_states tuple: record the residual stream entering each decoder layer."""
    captured = {}
    handles = []
    for index in layer_indices:
        def record(module, args, kwargs, index=index):
            captured[index] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        handles.append(model.model.layers[index].register_forward_pre_hook(record, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    finally:
        for handle in handles:
            handle.remove()
    return captured, logits


def _sglang_default_capture_layers(num_layers: int) -> list[int]:
    # Written from SGLang's set_eagle3_layers_to_capture (srt/models/llama.py) with no layer_ids given.
    return [2, num_layers // 2, num_layers - 3]


@pytest.mark.parametrize("layer_choice", ["sglang-default", "custom"])
def test_aux_hidden_is_the_input_of_the_layers_sglang_captures(target, val_sequences, layer_choice):
    model, n = target.model, target.num_layers
    if layer_choice == "sglang-default":
        aux_layer_ids = default_aux_layer_ids(n)
        capture_layers = _sglang_default_capture_layers(n)
    else:
        aux_layer_ids = [0, 2, n - 2]  # includes the deepest id SGLang can capture (input of the last layer)
        capture_layers = [i + 1 for i in aux_layer_ids]  # SGLang shifts configured ids by one
    input_ids = val_sequences[0][None, :]
    attention_mask = torch.ones_like(input_ids)

    aux_hidden, final_hidden = capture_aux_hidden(model, input_ids, attention_mask, aux_layer_ids)
    layer_inputs, logits = _layer_inputs_by_hooks(model, capture_layers, input_ids, attention_mask)

    h = target.hidden_size
    assert aux_hidden.shape == (1, input_ids.shape[1], len(aux_layer_ids) * h)
    for slot, layer in enumerate(capture_layers):
        torch.testing.assert_close(aux_hidden[..., slot * h : (slot + 1) * h], layer_inputs[layer], rtol=0, atol=0)
    # final_hidden is post-norm: exactly what the LM head multiplies.
    torch.testing.assert_close(model.lm_head(final_hidden), logits, rtol=0, atol=1e-6)


def test_final_hidden_is_the_normed_last_layer_output(target, val_sequences):
    model = target.model
    input_ids = val_sequences[1][None, :]
    last_layer_output = {}
    handle = model.model.layers[-1].register_forward_hook(
        lambda module, args, output: last_layer_output.setdefault("h", output[0] if isinstance(output, tuple) else output)
    )
    try:
        _, final_hidden = capture_aux_hidden(model, input_ids, None, default_aux_layer_ids(target.num_layers))
    finally:
        handle.remove()
    with torch.no_grad():
        normed = model.model.norm(last_layer_output["h"])
    torch.testing.assert_close(final_hidden, normed, rtol=0, atol=0)
    assert not torch.allclose(final_hidden, last_layer_output["h"]), "final_hidden must be after the final norm"


def test_batched_right_padded_equals_one_at_a_time(target, val_sequences):
    lengths = [len(s) for s in val_sequences]
    assert len(set(lengths)) > 1, "need sequences of different lengths to exercise padding"
    ids = default_aux_layer_ids(target.num_layers)
    batched = hidden_states_for_samples(target.model, val_sequences, ids, batch_size=4, pad_id=0, out_dtype=torch.float32)
    for sequence, (aux, final) in zip(val_sequences, batched):
        aux_alone, final_alone = capture_aux_hidden(target.model, sequence[None, :], None, ids)
        assert aux.shape[0] == len(sequence)
        torch.testing.assert_close(aux, aux_alone[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(final, final_alone[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "aux_layer_ids, message",
    [([], "no aux layer ids"), ([1, 7], "outside 0..6"), ([3, 1, 4], "ascending"), ([1, 1, 4], "ascending"), ([-1, 2], "outside")],
)
def test_ids_sglang_would_capture_differently_are_refused(aux_layer_ids, message):
    with pytest.raises(ValueError, match=message):
        check_capture_ids(aux_layer_ids, num_layers=8)
