"""The disk estimate printed before extraction equals the bytes the shards then hold (less safetensors headers)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from draftline.extract.shards import encode_shard, estimated_split_bytes, stored_bytes_per_token


@pytest.mark.parametrize("dtype,itemsize", [("float32", 4), ("bfloat16", 2)])
def test_estimate_equals_the_encoded_tensor_bytes(dtype, itemsize):
    num_aux, hidden = 3, 16
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    lengths = [5, 9, 2]
    samples = [
        {
            "input_ids": torch.arange(n),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "aux_hidden": torch.zeros(n, num_aux * hidden, dtype=torch_dtype),
            "final_hidden": torch.zeros(n, hidden, dtype=torch_dtype),
        }
        for n in lengths
    ]
    blob, tokens = encode_shard(samples, range(len(samples)), metadata={"format": "test"})
    header_bytes = 8 + struct.unpack("<Q", blob[:8])[0]
    json.loads(blob[8:header_bytes])  # the header is where we think it is
    assert stored_bytes_per_token(num_aux, hidden, dtype) == (num_aux + 1) * hidden * itemsize + 9
    assert estimated_split_bytes(len(samples), tokens, 1, num_aux, hidden, dtype) == len(blob) - header_bytes


def test_llama_8b_bf16_is_32_kib_of_hidden_states_per_token():
    # The arithmetic: 4 x 4096 x 2 bytes = 32 KiB per token, plus token id and mask.
    assert stored_bytes_per_token(3, 4096, "bfloat16") == 32 * 1024 + 9
