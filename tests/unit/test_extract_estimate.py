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


def test_the_estimate_is_printed_and_kept_before_extraction_and_warns_on_a_small_disk(tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    from draftline.extract import run
    from draftline.extract.storage import Storage
    from draftline.extract.worker import SplitTokens
    from tests.conftest import make_test_config

    cfg = make_test_config(tmp_path, extra=["extract.dtype=bfloat16", "extract.samples_per_shard=2"])
    root = Storage(tmp_path / "hidden")
    samples = [{"input_ids": list(range(n)), "loss_mask": [1] * n} for n in (4, 6, 3)]
    job = run.SplitJob("train", root.child("train"), SplitTokens.from_samples(samples), samples_per_shard=2)
    target = run.TargetInfo(target_dir=tmp_path, name="t", fingerprint="f", num_layers=8, hidden_size=64, pad_id=0)
    estimate = run.log_storage_estimate(cfg, [job], target, [1, 3, 4], root)
    per_token = 4 * 64 * 2 + 9
    assert estimate["bytes_per_token"] == per_token
    assert estimate["splits"]["train"]["estimated_bytes"] == 13 * per_token + 3 * 16 + 2 * 8
    assert json.loads((tmp_path / "hidden" / "storage_estimate.json").read_text()) == estimate
    printed = capsys.readouterr().out
    assert f"stored per token: {per_token} bytes" in printed and "WARNING" not in printed

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    run.log_storage_estimate(cfg, [job], target, [1, 3, 4], root)
    assert "WARNING" in capsys.readouterr().out
