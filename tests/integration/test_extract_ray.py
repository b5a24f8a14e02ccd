"""`extract` on a real local Ray cluster: two workers, train and val, rerun skips, a deleted shard is redone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from draftline.data.prepare import load_split
from draftline.extract.run import extract_with_stats
from draftline.extract.shards import HiddenStateShards, shard_file_name
from draftline.target.capture import capture_aux_hidden
from draftline.target.load import default_aux_layer_ids, load_target
from tests.conftest import make_test_config



def shards_of(split_dir: Path) -> list[Path]:
    return sorted(split_dir.glob("shard-*.safetensors"))


def _mtimes(split_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(split_dir.glob("shard-*.safetensors"))}


def test_two_workers_extract_train_and_val_then_rerun_resumes(ray_cluster, tiny_dataset_dir, tmp_path):
    cfg = make_test_config(extra=[
        f"extract.storage_uri={tmp_path / 'hidden'}",
        "extract.num_workers=2",
        "extract.samples_per_shard=16",
        "extract.batch_size=4",
    ])
    result = extract_with_stats(cfg, tiny_dataset_dir)
    root = Path(result.location)
    assert root.parent == tmp_path / "hidden"
    target = load_target(cfg)
    ids = default_aux_layer_ids(target.num_layers)

    for split in ("train", "val"):
        samples = load_split(tiny_dataset_dir, split)
        shards = HiddenStateShards(root / split)
        shards.verify()
        shards.check_compatible(target.fingerprint, ids, target.hidden_size)
        manifest = shards.manifest
        assert manifest["split"] == split and len(shards) == len(samples)
        assert manifest["total_tokens"] == sum(len(s["input_ids"]) for s in samples)
        assert manifest["sglang_capture_layers"] == [2, target.num_layers // 2, target.num_layers - 3]
        assert [shards[i]["sample_index"] for i in range(len(shards))] == list(range(len(samples)))
        assert manifest["bytes_per_token"] >= manifest["hidden_bytes_per_token"]
        for index in (0, len(samples) - 1):
            stored = shards[index]
            input_ids = torch.tensor(samples[index]["input_ids"])
            assert torch.equal(stored["input_ids"], input_ids)
            aux, final = capture_aux_hidden(target.model, input_ids[None, :], None, ids)
            torch.testing.assert_close(stored["aux_hidden"], aux[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(stored["final_hidden"], final[0], rtol=0, atol=1e-5)
    assert result.splits["train"].manifest["last_run"]["shards_written"] == len(shards_of(root / "train"))
    # The estimate printed before extraction: the shard bytes less their headers (under 2 KiB a shard here).
    estimate = json.loads((root / "storage_estimate.json").read_text())
    for split in ("train", "val"):
        manifest = result.splits[split].manifest
        headers = manifest["total_bytes"] - estimate["splits"][split]["estimated_bytes"]
        assert 0 < headers < 2048 * len(manifest["shards"])

    # A rerun with nothing missing is a no-op.
    before = {split: _mtimes(root / split) for split in ("train", "val")}
    again = extract_with_stats(cfg, tiny_dataset_dir)
    assert all(r.cached for r in again.splits.values())
    assert {split: _mtimes(root / split) for split in ("train", "val")} == before

    # Deleting one shard (what verify() tells the user to do) redoes only that shard, with the same sha256
    # (fault 8: safetensors metadata order made a bit-identical shard look new, and everything downstream rerun).
    manifest_before = (root / "train" / "manifest.json").read_text()
    (root / "train" / shard_file_name(1)).unlink()
    redo = extract_with_stats(cfg, tiny_dataset_dir, split="train")
    assert redo.splits["train"].manifest["last_run"]["shards_written"] == 1
    after = _mtimes(root / "train")
    changed = [name for name in after if after[name] != before["train"][name]]
    assert changed == [shard_file_name(1)]
    assert [s["sha256"] for s in redo.splits["train"].manifest["shards"]] == [
        s["sha256"] for s in json.loads(manifest_before)["shards"]
    ]
    HiddenStateShards(root / "train").verify()

    # Fault 1: a shard overwritten in place at the same size is not "cached": the rerun redoes exactly that shard.
    victim = root / "train" / shard_file_name(2)
    with open(victim, "r+b") as handle:
        handle.seek(victim.stat().st_size // 2)
        handle.write(b"\xff" * 8192)
    fixed = extract_with_stats(cfg, tiny_dataset_dir, split="train")
    assert not fixed.splits["train"].cached
    assert fixed.splits["train"].manifest["last_run"]["shards_written"] == 1
    assert (root / "train" / "manifest.json").read_text().count('"sha256"') == len(shards_of(root / "train"))
    HiddenStateShards(root / "train").verify()
    shutil.rmtree(root)
