"""Shard writer, resume logic and reader, run in-process on the tiny target (Ray is exercised in tests/e2e)."""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
import torch

import draftline.extract.worker as worker_module
from draftline.data.prepare import load_split
from draftline.extract.shards import (
    HiddenStateShards,
    IncompatibleHiddenStates,
    ShardError,
    build_manifest,
    num_shards,
    read_shard_record,
    shard_file_name,
    write_manifest,
)
from draftline.extract.storage import Storage
from draftline.extract.worker import SplitTokens, run_worker_shards
from draftline.target.capture import capture_aux_hidden
from draftline.target.load import default_aux_layer_ids, load_target

SAMPLES_PER_SHARD = 5


@pytest.fixture(scope="module")
def target(tiny_cfg, tiny_target_dir):
    return load_target(tiny_cfg, target_dir=tiny_target_dir)


@pytest.fixture(scope="module")
def val_samples(tiny_dataset_dir):
    samples = load_split(tiny_dataset_dir, "val")[:12]
    assert len(samples) == 12, "the tiny dataset's val split should have at least 12 samples"
    return samples


def _plan(target, dtype="float32"):
    return {
        "aux_layer_ids": default_aux_layer_ids(target.num_layers),
        "samples_per_shard": SAMPLES_PER_SHARD,
        "batch_size": 3,
        "pad_id": 0,
        "dtype": dtype,
        "shard_metadata": {"format": "draftline-hidden-states"},
    }


def _write_all(target, split_tokens, storage, plan, world_size=1):
    return [run_worker_shards(target.model, split_tokens, storage, rank, world_size, plan) for rank in range(world_size)]


def _finish(storage, target, split_tokens, plan):
    total = num_shards(len(split_tokens), plan["samples_per_shard"])
    records = [read_shard_record(storage, i) for i in range(total)]
    manifest = build_manifest(
        records,
        target_fingerprint=target.fingerprint,
        target_name="tiny",
        target_dtype="float32",
        num_layers=target.num_layers,
        hidden_size=target.hidden_size,
        aux_layer_ids=plan["aux_layer_ids"],
        dtype=plan["dtype"],
        dataset_hash="test",
        split="val",
        samples_per_shard=plan["samples_per_shard"],
        total_samples=len(split_tokens),
    )
    write_manifest(storage, manifest)
    return HiddenStateShards(storage.location)


def test_extraction_goes_through_capture_aux_hidden(target, val_samples, tmp_path, monkeypatch):
    calls = []

    def counting_capture(*args, **kwargs):
        calls.append(args[1].shape)
        return capture_aux_hidden(*args, **kwargs)

    monkeypatch.setattr(worker_module, "capture_aux_hidden", counting_capture)
    split_tokens = SplitTokens.from_samples(val_samples)
    plan = _plan(target)
    storage = Storage(tmp_path / "val")
    _write_all(target, split_tokens, storage, plan)
    shards = _finish(storage, target, split_tokens, plan)

    assert sum(shape[0] for shape in calls) == len(val_samples)
    assert any(shape[0] > 1 for shape in calls), "extraction should batch samples"
    for index, sample in enumerate(val_samples):
        stored = shards[index]
        input_ids = torch.tensor(sample["input_ids"])
        aux, final = capture_aux_hidden(target.model, input_ids[None, :], None, plan["aux_layer_ids"])
        assert torch.equal(stored["input_ids"], input_ids)
        assert stored["loss_mask"].tolist() == sample["loss_mask"]
        assert stored["sample_index"] == index
        torch.testing.assert_close(stored["aux_hidden"], aux[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(stored["final_hidden"], final[0], rtol=0, atol=1e-5)


def test_shards_hold_fixed_ranges_and_workers_own_i_mod_w(target, val_samples, tmp_path):
    split_tokens = SplitTokens.from_samples(val_samples)
    plan = _plan(target, dtype="bfloat16")
    storage = Storage(tmp_path / "val")
    counts = _write_all(target, split_tokens, storage, plan, world_size=2)
    # 12 samples / 5 per shard = shards 0, 1, 2; rank 0 owns 0 and 2, rank 1 owns 1.
    assert [c["written"] for c in counts] == [2, 1]
    shards = _finish(storage, target, split_tokens, plan)
    assert [(s["first_sample"], s["samples"]) for s in shards.manifest["shards"]] == [(0, 5), (5, 5), (10, 2)]
    assert [shards[i]["sample_index"] for i in range(len(shards))] == list(range(len(val_samples)))
    assert shards[0]["aux_hidden"].dtype == torch.bfloat16
    assert shards.manifest["total_tokens"] == sum(len(s["input_ids"]) for s in val_samples)
    shards.verify()


def test_rerun_skips_complete_shards_and_redoes_a_corrupt_one(target, val_samples, tmp_path):
    split_tokens = SplitTokens.from_samples(val_samples)
    plan = _plan(target)
    storage = Storage(tmp_path / "val")
    _write_all(target, split_tokens, storage, plan)
    before = {i: storage.mtime_ns(shard_file_name(i)) for i in range(3)}

    assert _write_all(target, split_tokens, storage, plan)[0] == {"rank": 0, "written": 0, "skipped": 3}

    corrupt = tmp_path / "val" / shard_file_name(1)
    corrupt.write_bytes(corrupt.read_bytes()[:-100])
    assert _write_all(target, split_tokens, storage, plan)[0] == {"rank": 0, "written": 1, "skipped": 2}
    after = {i: storage.mtime_ns(shard_file_name(i)) for i in range(3)}
    assert after[0] == before[0] and after[2] == before[2]
    assert after[1] != before[1]
    _finish(storage, target, split_tokens, plan).verify()


def test_verify_names_a_truncated_or_corrupt_shard_and_the_fix(target, val_samples, tmp_path):
    split_tokens = SplitTokens.from_samples(val_samples)
    plan = _plan(target)
    storage = Storage(tmp_path / "val")
    _write_all(target, split_tokens, storage, plan)
    shards = _finish(storage, target, split_tokens, plan)
    shards.verify()

    path = tmp_path / "val" / shard_file_name(2)
    original = path.read_bytes()
    path.write_bytes(original[: len(original) // 2])
    with pytest.raises(ShardError, match=rf"{shard_file_name(2)} is truncated.*delete .*rerun `draftline extract`"):
        shards.verify()
    with pytest.raises(ShardError, match=rf"{shard_file_name(2)} is corrupt .*sha256 differs"):
        HiddenStateShards(storage.location)[11]

    flipped = bytearray(original)
    flipped[-1] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(ShardError, match=rf"{shard_file_name(2)} is corrupt \(sha256 mismatch\).*delete"):
        shards.verify()


def test_check_compatible_refuses_another_target_or_layer_set(target, val_samples, tmp_path):
    split_tokens = SplitTokens.from_samples(val_samples[:SAMPLES_PER_SHARD])
    plan = _plan(target)
    storage = Storage(tmp_path / "val")
    _write_all(target, split_tokens, storage, plan)
    shards = _finish(storage, target, split_tokens, plan)
    ids, h = plan["aux_layer_ids"], target.hidden_size

    shards.check_compatible(target.fingerprint, ids, h)
    with pytest.raises(IncompatibleHiddenStates, match="target fingerprint .*Rerun `draftline extract`"):
        shards.check_compatible("0" * 16, ids, h)
    with pytest.raises(IncompatibleHiddenStates, match=r"aux_layer_ids \[.*\] != \[0, 1, 2\]"):
        shards.check_compatible(target.fingerprint, [0, 1, 2], h)
    with pytest.raises(IncompatibleHiddenStates, match=f"hidden_size {h} != {h * 2}"):
        shards.check_compatible(target.fingerprint, ids, h * 2)


def test_reader_without_manifest_says_what_to_run(tmp_path):
    with pytest.raises(ShardError, match="no manifest.json .*draftline extract"):
        HiddenStateShards(tmp_path)


def test_storage_accepts_file_uris(tmp_path):
    storage = Storage((tmp_path / "x").as_uri())
    storage.write_bytes("a.json", json.dumps({"k": 1}).encode())
    assert storage.list_names() == ["a.json"]
    assert json.loads(storage.read_bytes("a.json")) == {"k": 1}
    assert storage.remove_temp_files() == 0


def test_reader_refuses_a_shard_overwritten_in_place_at_the_same_size(target, val_samples, tmp_path):
    """Fault 1: the reader checked only sizes, so 8 KiB of 0xFF written into a shard was trained on (loss nan)."""
    split_tokens = SplitTokens.from_samples(val_samples)
    plan = _plan(target)
    storage = Storage(tmp_path / "val")
    _write_all(target, split_tokens, storage, plan)
    _finish(storage, target, split_tokens, plan)
    path = tmp_path / "val" / shard_file_name(0)
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size - 8192)
        handle.write(b"\xff" * 8192)
    assert path.stat().st_size == size
    with pytest.raises(ShardError, match=rf"{shard_file_name(0)} is corrupt .*sha256 differs.*delete .*rerun"):
        HiddenStateShards(storage.location)[0]
    assert HiddenStateShards(storage.location)[5]["sample_index"] == 5  # the other shards stay readable


def test_encoding_the_same_tensors_gives_the_same_bytes(target, val_samples):
    """Fault 8: safetensors wrote metadata in hash order, so identical tensors got a different sha256 per run."""
    from draftline.extract.shards import encode_shard

    samples = [{"input_ids": torch.tensor(s["input_ids"]), "loss_mask": torch.tensor(s["loss_mask"]),
                "aux_hidden": torch.zeros(len(s["input_ids"]), 6), "final_hidden": torch.ones(len(s["input_ids"]), 2)}
               for s in val_samples[:3]]
    metadata = {f"key{i}": str(i) for i in range(8)}
    blobs = {encode_shard(samples, [0, 1, 2], dict(reversed(metadata.items())) if i % 2 else metadata)[0]
             for i in range(20)}
    assert len(blobs) == 1


@pytest.mark.parametrize("error_number", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_full_disk_stops_the_worker_at_once_with_one_clear_line(target, val_samples, tmp_path, monkeypatch,
                                                                   error_number):
    """Fault 13: ENOSPC was raised out of the worker, so Ray Train retried the group 3 times (61 s) to fail the same
    way, and the message was buried in a traceback. Now the worker stops at the first failed write and returns it."""
    split_tokens = SplitTokens.from_samples(val_samples)
    plan = {**_plan(target), "samples_per_shard": 2}  # 6 shards
    storage = Storage(tmp_path / "val")
    write_bytes, computed = Storage._write_bytes, []

    def disk_fills_at_the_second_shard(self, name, data):
        if name == shard_file_name(1):
            raise OSError(error_number, os.strerror(error_number))
        write_bytes(self, name, data)

    def counting_extract_shard(*args, **kwargs):
        computed.append(args[2])
        return extract_shard(*args, **kwargs)

    extract_shard = worker_module.extract_shard
    monkeypatch.setattr(Storage, "_write_bytes", disk_fills_at_the_second_shard)
    monkeypatch.setattr(worker_module, "extract_shard", counting_extract_shard)
    counts = run_worker_shards(target.model, split_tokens, storage, 0, 1, plan)

    assert counts["written"] == 1 and computed == [0, 1, 2], "the worker must stop, not go on to the other shards"
    message = counts["storage_full"]
    assert "\n" not in message
    assert message.startswith(f"cannot write {storage.uri(shard_file_name(1))}: {os.strerror(error_number)} (")
    assert re.search(r"\(\d+\.\d MB free there\); free space or point data_dir \(or extract.storage_uri\)", message)
    assert read_shard_record(storage, 0) is not None and read_shard_record(storage, 1) is None
