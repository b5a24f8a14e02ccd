"""benchmarks/specforge_side_by_side.py's converters, with SpecForge 0.2.0's own training code between them.

draftline's hidden-state shards of the test target (extracted in-process) become SpecForge offline feature files;
benchmarks/specforge_train.py trains SpecForge's drafter on them for two steps in SpecForge's overlay (`make peers`:
its data normaliser, collator, vocab mapping, model, loss, optimizer and `export_to_hf`), and its export becomes a
draftline export that draftline's loader and val loop read. The full-size run's figures are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import load_script
from draftline.data.prepare import load_split
from draftline.drafter.export import export_drafter, load_drafter
from draftline.extract.shards import HiddenStateShards, build_manifest, num_shards, read_shard_record, write_manifest
from draftline.extract.storage import Storage
from draftline.extract.worker import SplitTokens, run_worker_shards
from draftline.target.load import default_aux_layer_ids, load_target
from registry_helpers import random_drafter

SAMPLES = 8
STEPS = 2


def _script():
    return load_script("benchmarks/specforge_side_by_side.py")


def _extract(cfg, target_dir, samples, location: Path) -> HiddenStateShards:
    target = load_target(cfg, target_dir=target_dir)
    tokens = SplitTokens.from_samples(samples)
    aux_ids = default_aux_layer_ids(target.num_layers)
    plan = {"aux_layer_ids": aux_ids, "samples_per_shard": 5, "batch_size": 4, "pad_id": 0, "dtype": "float32",
            "shard_metadata": {"format": "draftline-hidden-states"}}  # fmt: skip
    storage = Storage(location)
    run_worker_shards(target.model, tokens, storage, 0, 1, plan)
    records = [read_shard_record(storage, i) for i in range(num_shards(len(samples), plan["samples_per_shard"]))]
    write_manifest(storage, build_manifest(
        records, target_fingerprint=target.fingerprint, target_name="tiny", target_dtype="float32",
        num_layers=target.num_layers, hidden_size=target.hidden_size, aux_layer_ids=aux_ids, dtype="float32",
        dataset_hash="test", split=location.name, samples_per_shard=plan["samples_per_shard"], total_samples=len(samples),
    ))  # fmt: skip
    return HiddenStateShards(location)


@pytest.fixture(scope="module")
def side_by_side(tiny_cfg, tiny_target_dir, tiny_dataset_dir, tmp_path_factory):
    """(script, hidden dir with train/ and val/ (the same samples), features dir, the SpecForge run's dir)."""
    script = _script()
    root = tmp_path_factory.mktemp("specforge-side-by-side")
    samples = load_split(tiny_dataset_dir, "val")[:SAMPLES]
    assert len(samples) == SAMPLES, "the tiny dataset's val split should have at least 8 samples"
    for split in ("train", "val"):
        _extract(tiny_cfg, tiny_target_dir, samples, root / "hidden" / split)
    features = root / "features"
    for split in ("train", "val"):
        assert script.to_specforge_features(root / "hidden" / split, features / split) == SAMPLES
    draft_config = export_drafter(random_drafter(tiny_target_dir, draft_vocab_size=512, seed=1), root / "draft") / "config.json"
    args = SimpleNamespace(steps=STEPS, batch_size=4, lr=1e-3, warmup_steps=1, ttt_length=3, max_len=256, val_every=1,
                           train_timeout_s=600)  # fmt: skip
    script.train_specforge(args, features, draft_config, Path(tiny_target_dir), root / "specforge")
    return script, root / "hidden", features, root / "specforge"


def test_features_are_the_shards_under_specforges_names(side_by_side):
    _, hidden, features, _ = side_by_side
    shards = HiddenStateShards(hidden / "train")
    files = sorted((features / "train").glob("*.ckpt"))
    assert len(files) == len(shards)
    for index, path in enumerate(files):
        feature, sample = torch.load(path, weights_only=True), shards[index]
        assert set(feature) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert torch.equal(feature["input_ids"], sample["input_ids"])
        assert torch.equal(feature["loss_mask"], sample["loss_mask"].long())
        # SpecForge's TargetHead turns hidden_state into the teacher's logits; aux_hidden_state is its fc input.
        assert torch.equal(feature["hidden_state"], sample["final_hidden"][None])
        assert torch.equal(feature["aux_hidden_state"], sample["aux_hidden"][None])


def test_specforge_trains_on_the_features_and_its_export_becomes_a_draftline_export(side_by_side, tiny_target_dir,
                                                                                    tmp_path):  # fmt: skip
    script, hidden, _, run = side_by_side
    history = json.loads((run / "history.json").read_text())["history"]
    assert [row["step"] for row in history] == list(range(1, STEPS + 1))
    assert all(0.0 <= row["val_acc_0"] <= 1.0 and torch.isfinite(torch.tensor(row["loss"])) for row in history)
    assert (run / f"export-step{STEPS - 1}").is_dir()  # an earlier step's drafter, for a run stopped early

    specforge_tensors = load_file(str(run / "export" / "model.safetensors"))
    assert "embed_tokens.weight" in specforge_tensors  # SpecForge ships the target's embedding; draftline does not
    converted = script.from_specforge_export(run / "export", tmp_path / "as-draftline")
    drafter = load_drafter(converted)
    ours = drafter.state_dict()
    assert set(ours) == set(specforge_tensors) - {"embed_tokens.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, specforge_tensors[name].to(tensor.dtype)), name
    # SpecForge's vocab mapping (its most frequent loss-masked tokens), as the engines read it.
    assert int(drafter.t2d.sum()) == drafter.config.draft_vocab_size == 512

    metrics = script.val_metrics(converted, hidden / "val", Path(tiny_target_dir), steps=3)
    assert set(metrics) == {"val_acc_0", "val_acc_1", "val_acc_2", "val_est_accept_len"}
    assert 1.0 <= metrics["val_est_accept_len"] <= 4.0
