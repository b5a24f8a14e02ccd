"""The online stream's order and its checks, in-process (the real Ray run is tests/e2e/test_train_online.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftline.config import ConfigError, load_config
from draftline.extract.online import TRAIN, VAL, _object_column, from_wire, shard_sizes_for, to_wire
from draftline.train.order import is_validation_step, rank_stream_rows, sample_indices_for_step, val_indices_for_rank
from draftline.train.stream import StreamOrderError, StreamReader

SEED, WORLD, BATCH = 3, 2, 4
NUM_TRAIN, NUM_VAL = 37, 7


def train_cfg(max_steps=12):
    return load_config(None, [f"train.max_steps={max_steps}", f"train.micro_batch_size={BATCH}", "train.val_every=5",
                              "train.checkpoint_every=10"]).train


def test_each_rank_streams_the_offline_order_and_together_every_position_once():
    cfg = train_cfg()
    sizes = shard_sizes_for(NUM_TRAIN, 8)
    assert sizes == [8, 8, 8, 8, 5]  # what offline extraction writes with samples_per_shard=8
    for rank in range(WORLD):
        rows = rank_stream_rows(rank, WORLD, cfg, sizes, NUM_VAL, SEED)
        expected = []
        for step in range(1, cfg.max_steps + 1):
            expected += [(TRAIN, step, i) for i in sample_indices_for_step(step - 1, rank, WORLD, BATCH, sizes, SEED)]
            if is_validation_step(step, cfg):
                expected += [(VAL, step, i) for i in val_indices_for_rank(NUM_VAL, rank, WORLD)]
        assert [(r["split"], r["step"], r["sample_index"]) for r in rows] == expected
    # The ranks' train rows together, in global order: each epoch is a permutation of the split.
    global_order = [r["sample_index"] for step in range(1, cfg.max_steps + 1) for rank in range(WORLD)
                    for r in rank_stream_rows(rank, WORLD, cfg, sizes, NUM_VAL, SEED)
                    if r["split"] == TRAIN and r["step"] == step]
    assert len(global_order) == cfg.max_steps * WORLD * BATCH == 96
    assert sorted(global_order[:NUM_TRAIN]) == sorted(global_order[NUM_TRAIN : 2 * NUM_TRAIN]) == list(range(NUM_TRAIN))


class FakeIterator:
    """What ray.train.get_dataset_shard returns, reduced to the call StreamReader makes; blocks as the target
    actors emit them (ragged columns)."""

    def __init__(self, rows, dtype="float32", block_rows=3):
        self.rows, self.dtype, self.block_rows = rows, dtype, block_rows

    def sample(self, row):
        length = 2 + row["sample_index"] % 5
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]
        generator = torch.Generator().manual_seed(row["sample_index"])
        return {
            "input_ids": torch.arange(length, dtype=torch.int64) + row["sample_index"],
            "loss_mask": torch.ones(length, dtype=torch.uint8),
            "aux_hidden": torch.randn(length, 12, generator=generator).to(torch_dtype),
            "final_hidden": torch.randn(length, 4, generator=generator).to(torch_dtype),
        }

    def iter_batches(self, batch_size, batch_format, prefetch_batches):
        assert batch_size is None and batch_format == "numpy"
        for start in range(0, len(self.rows), self.block_rows):
            block = self.rows[start : start + self.block_rows]
            samples = [self.sample(r) for r in block]
            yield {
                **{name: np.array([r[name] for r in block]) for name in ("split", "step", "sample_index")},
                **{name: _object_column([to_wire(s[name]) for s in samples]) for name in samples[0]},
            }


def reader(rows, rank=0, dtype="float32"):
    cfg = train_cfg()
    return StreamReader(FakeIterator(rows, dtype), rank, WORLD, BATCH, shard_sizes_for(NUM_TRAIN, 8), NUM_VAL, SEED,
                        dtype, prefetch_blocks=1), cfg


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_reader_hands_out_the_streamed_samples_in_training_micro_batches(dtype):
    cfg = train_cfg()
    rows = rank_stream_rows(1, WORLD, cfg, shard_sizes_for(NUM_TRAIN, 8), NUM_VAL, SEED)
    stream, cfg = reader(rows, rank=1, dtype=dtype)
    fake = FakeIterator(rows, dtype)
    for step in range(cfg.max_steps):
        samples = stream.train_samples(step)
        ids = sample_indices_for_step(step, 1, WORLD, BATCH, shard_sizes_for(NUM_TRAIN, 8), SEED)
        assert [s["sample_index"] for s in samples] == ids
        for sample in samples:
            want = fake.sample({"sample_index": sample["sample_index"]})
            for name, tensor in want.items():
                assert sample[name].dtype == tensor.dtype and torch.equal(sample[name], tensor), name
        if is_validation_step(step + 1, cfg):
            val = [s["sample_index"] for batch in stream.val_batches(step + 1) for s in batch]
            assert val == list(val_indices_for_rank(NUM_VAL, 1, WORLD))
    itemsize = 2 if dtype == "bfloat16" else 4
    assert stream.bytes_per_token == 16 * itemsize + 8 + 1


def test_a_lost_or_repeated_sample_is_an_error_not_a_silently_different_batch():
    cfg = train_cfg()
    rows = rank_stream_rows(0, WORLD, cfg, shard_sizes_for(NUM_TRAIN, 8), NUM_VAL, SEED)
    repeated = rows[:2] + rows[1:]
    stream, _ = reader(repeated)
    with pytest.raises(StreamOrderError, match="lost, repeated or reordered"):
        stream.train_samples(0)
    lost = rows[:1] + rows[2:]
    stream, _ = reader(lost)
    with pytest.raises(StreamOrderError):
        stream.train_samples(0)
    # A resumed worker's stream starts after its checkpoint step; reading from an earlier step is refused.
    stream, _ = reader([r for r in rows if r["step"] > 3])
    with pytest.raises(StreamOrderError):
        stream.train_samples(2)
    stream, _ = reader([r for r in rows if r["step"] > 3])
    assert [s["sample_index"] for s in stream.train_samples(3)] == [r["sample_index"] for r in rows if r["step"] == 4][:BATCH]


def test_bfloat16_travels_bit_exact():
    tensor = torch.randn(5, 7).to(torch.bfloat16)
    assert torch.equal(from_wire(to_wire(tensor), "bfloat16"), tensor)


def test_mode_is_offline_by_default_and_checked():
    assert load_config(None).extract.mode == "offline"
    assert load_config(None, ["extract.mode=online"]).extract.online.actors_per_train_worker == 1
    with pytest.raises(ConfigError, match="extract.mode"):
        load_config(None, ["extract.mode=streaming"])


def test_draftline_extract_online_prints_bytes_per_token_and_writes_nothing(tiny_target_dir, tiny_dataset_dir,
                                                                            tmp_path, capsys):
    """`draftline extract` in online mode (and the extract stage of `draftline run`, which prints the same line):
    before training starts, the bytes per token the stream will carry and the total per epoch; no shard."""
    from draftline.extract.cli import run_extract
    from draftline.extract.shards import stored_bytes_per_token
    from draftline.utils import read_json
    from tests.conftest import make_test_config

    cfg = make_test_config(tmp_path, ["extract.mode=online", "target.kind=hf", f"target.path={tiny_target_dir}"])
    assert run_extract(cfg, str(tiny_dataset_dir), "all") == 0
    out = capsys.readouterr().out
    per_token = stored_bytes_per_token(3, 96, "float32")  # 3 aux + final state x H=96 in fp32, token id, mask
    tokens = sum(read_json(tiny_dataset_dir / "report.json")["tokens"][split] for split in ("train", "val"))
    assert f"0 bytes on disk (no shards); training streams {per_token} bytes per token" in out
    assert f"{per_token * tokens / 1e9:.3f} GB per epoch of the {tokens} train + val tokens" in out
    assert list(tmp_path.rglob("shard-*")) == [] and not (tmp_path / "hidden").exists()
