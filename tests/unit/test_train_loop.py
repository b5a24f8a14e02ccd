"""Pieces of the training worker and driver that run without Ray (tiny tensors)."""

from __future__ import annotations

import errno
import math
import os
import re
import tempfile
from types import SimpleNamespace

import pytest
import torch

from draftline.config import ConfigError, load_config
from draftline.drafter.export import export_drafter
from draftline.drafter.model import DrafterConfig
from draftline.drafter.ttt import est_accept_len, target_signals, ttt_loss
from draftline.faults import Fault
from draftline.train.data import TargetHead, collate, load_target_head
from draftline.train.job import OnlineStream, TrainingJob
from draftline.train.loop import (
    StepMetrics,
    TTTObjective,
    build_drafter,
    deepspeed_config,
    fire_fault,
    lr_multiplier,
    objective_inputs,
    save_and_report,
    start_from_export,
)
from draftline.train.order import is_checkpoint_step, is_validation_step
from draftline.train.run import check_init_from, flatten
from draftline.utils import StorageFullError

HIDDEN, TARGET_VOCAB, DRAFT_VOCAB = 16, 40, 24


def _drafter_config() -> DrafterConfig:
    return DrafterConfig(
        hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
        draft_vocab_size=DRAFT_VOCAB, target_vocab_size=TARGET_VOCAB, target_hidden_size=HIDDEN,
        aux_layer_ids=(1, 3, 4),
    )


def _vocab() -> tuple[torch.Tensor, torch.Tensor]:
    draft_targets = torch.randperm(TARGET_VOCAB, generator=torch.Generator().manual_seed(1))[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(TARGET_VOCAB, dtype=torch.bool)
    t2d[draft_targets] = True
    return draft_targets - torch.arange(DRAFT_VOCAB), t2d


def _samples(lengths=(7, 5)) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, TARGET_VOCAB, (n,), generator=generator),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "aux_hidden": torch.randn(n, 3 * HIDDEN, generator=generator),
            "final_hidden": torch.randn(n, HIDDEN, generator=generator),
        }
        for n in lengths
    ]


def test_the_drafter_norm_starts_as_the_targets_final_norm_when_asked():
    norm = torch.rand(HIDDEN) + 0.5
    head = TargetHead(torch.randn(TARGET_VOCAB, HIDDEN), torch.randn(TARGET_VOCAB, HIDDEN), norm)
    d2t, t2d = _vocab()
    config = _drafter_config()
    assert torch.equal(build_drafter(config, head, d2t, t2d, init_norm_from_target=True).norm.weight, norm)
    assert torch.equal(build_drafter(config, head, d2t, t2d).norm.weight, torch.ones(HIDDEN))
    with pytest.raises(ValueError, match="final norm weight is None.*init_norm_from_target=false"):
        build_drafter(config, TargetHead(head.embed_weight, head.lm_head_weight), d2t, t2d, init_norm_from_target=True)


def test_the_training_job_crosses_into_the_workers_typed_and_whole(tmp_path):
    """train_loop_config is written by TrainingJob.to_loop_config and read by from_loop_config only; a pickled
    round trip (what Ray does) keeps every field, and a dict of loose fields is refused naming the fix."""
    import pickle

    d2t, t2d = _vocab()
    job = TrainingJob(cfg=load_config(None, ["train.max_steps=7"]), target_dir=str(tmp_path), d2t=d2t, t2d=t2d,
                      drafter_config=_drafter_config(), tracking_uri="sqlite:///x.db", run_id="r1",
                      train_location="/h/train", val_location="/h/val",
                      fault=Fault("train.step", 3, str(tmp_path / "marker")))
    job = job.with_run("/ck/train-x", storage_full_sink=None, online=OnlineStream(None, [8, 5], 3))
    back = TrainingJob.from_loop_config(pickle.loads(pickle.dumps(job.to_loop_config())))
    assert back.cfg.train.max_steps == 7 and back.drafter_config == job.drafter_config and torch.equal(back.t2d, t2d)
    assert (back.checkpoint_location, back.online.shard_sizes, back.fault.count) == ("/ck/train-x", [8, 5], 3)
    with pytest.raises(TypeError, match="TrainingJob.to_loop_config"):
        TrainingJob.from_loop_config({"config": {}, "run_id": "r1"})


def test_target_head_reads_the_final_norm(tiny_target_dir):
    from safetensors.torch import load_file

    head = load_target_head(tiny_target_dir)
    weights = load_file(next(tiny_target_dir.glob("*.safetensors")))
    assert torch.equal(head.final_norm_weight, weights["model.norm.weight"])


def test_objective_is_ttt_loss_on_frozen_target_signals():
    torch.manual_seed(0)
    head = TargetHead(torch.randn(TARGET_VOCAB, HIDDEN), torch.randn(TARGET_VOCAB, HIDDEN))
    d2t, t2d = _vocab()
    drafter = build_drafter(_drafter_config(), head, d2t, t2d)
    assert torch.equal(drafter.lm_head.weight, head.lm_head_weight[t2d])
    objective = TTTObjective(drafter, steps=3, decay=0.8, loss="soft")
    batch = collate(_samples())
    loss, metrics = objective(*objective_inputs(batch, head, t2d, torch.float32))

    full_logits = batch.final_hidden @ head.lm_head_weight.t()
    draft_logits, target_ids = target_signals(full_logits, t2d)
    expected, expected_metrics = ttt_loss(
        drafter, head.embed_weight[batch.input_ids], batch.aux_hidden, draft_logits, batch.loss_mask,
        target_ids=target_ids, attention_mask=batch.attention_mask, steps=3, decay=0.8, loss="soft",
    )
    assert torch.allclose(loss, expected)
    assert metrics == expected_metrics
    loss.backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0


def test_step_metrics_weight_by_count_and_give_est_accept_len():
    totals = StepMetrics(steps=2)
    totals.add(1.0, {"loss_0": 2.0, "acc_0": 1.0, "count_0": 3, "loss_1": 4.0, "acc_1": 0.0, "count_1": 1}, tokens=10)
    totals.add(3.0, {"loss_0": 1.0, "acc_0": 0.0, "count_0": 1, "loss_1": 1.0, "acc_1": 1.0, "count_1": 3}, tokens=5)
    out = totals.averages(prefix="val_")
    assert out["val_loss"] == pytest.approx(2.0)
    assert out["val_loss_0"] == pytest.approx((2 * 3 + 1) / 4)
    assert out["val_acc_0"] == pytest.approx(0.75)
    assert out["val_acc_1"] == pytest.approx(0.75)
    assert out["val_est_accept_len"] == pytest.approx(est_accept_len([0.75, 0.75]))
    assert totals.tokens == 15


def test_lr_schedule_warms_up_then_decays_to_floor():
    assert lr_multiplier(0, warmup_steps=4, max_steps=20) == pytest.approx(0.25)
    assert lr_multiplier(3, warmup_steps=4, max_steps=20) == pytest.approx(1.0)
    assert lr_multiplier(4, warmup_steps=4, max_steps=20) == pytest.approx(1.0)
    assert lr_multiplier(12, warmup_steps=4, max_steps=20) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_multiplier(20, warmup_steps=4, max_steps=20) == pytest.approx(0.1)
    assert lr_multiplier(0, warmup_steps=0, max_steps=20) == pytest.approx(1.0)


def test_checkpoint_and_validation_cadence():
    cfg = load_config(None, ["train.max_steps=25", "train.checkpoint_every=10", "train.val_every=4"]).train
    checkpoints = [s for s in range(1, 26) if is_checkpoint_step(s, cfg)]
    validations = [s for s in range(1, 26) if is_validation_step(s, cfg)]
    assert checkpoints == [10, 20, 25]
    assert validations == [4, 8, 10, 12, 16, 20, 24, 25]  # every checkpoint carries fresh val metrics


def test_deepspeed_config_follows_train_section():
    cpu = deepspeed_config(load_config(None, ["train.micro_batch_size=3", "train.zero_stage=1"]).train)
    assert cpu["train_micro_batch_size_per_gpu"] == 3 and cpu["zero_optimization"] == {"stage": 1}
    assert cpu["bf16"] == {"enabled": False}
    gpu = deepspeed_config(load_config(None, ["train.dtype=bfloat16", "train.zero_stage=2"]).train)
    assert gpu["bf16"] == {"enabled": True} and gpu["zero_optimization"] == {"stage": 2}


def test_the_train_step_fault_fires_once_on_the_last_rank_only(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr("draftline.faults.os.kill", lambda pid, sig: events.append("kill"))

    def kill_hook(fault, step, rank):
        fire_fault(fault, step, rank, world_size=2, wait_for_checkpoints=lambda: events.append("wait"))

    fault = Fault("train.step", 3, str(tmp_path / "marker"))
    kill_hook(fault, step=3, rank=0)
    kill_hook(fault, step=2, rank=1)
    assert not events
    kill_hook(fault, step=3, rank=1)
    kill_hook(fault, step=3, rank=1)  # the restarted attempt passes the marker
    assert events == ["wait", "kill"] and (tmp_path / "marker").exists()
    kill_hook(None, step=3, rank=1)
    assert events == ["wait", "kill"]


def test_the_train_step_fault_can_hold_for_a_node_kill_instead(tmp_path, monkeypatch):
    """Action "hold" (tests/e2e/test_multinode.py): the rank waits, after the checkpoints are committed, for the
    test to kill its whole node; it does not kill itself."""
    events = []
    monkeypatch.setattr("draftline.faults.os.kill", lambda pid, sig: events.append("kill"))
    monkeypatch.setattr("draftline.faults.hold_until_killed", lambda marker, what: events.append(("hold", what)))
    fault = Fault("train.step", 3, str(tmp_path / "marker"), action="hold")
    fire_fault(fault, 3, 1, world_size=2, wait_for_checkpoints=lambda: events.append("wait"))
    assert events[0] == "wait" and events[1][0] == "hold" and "train.step 3" in events[1][1]


def test_flatten_config_for_mlflow_params():
    flat = flatten(load_config(None, ["train.lr=0.001"]).model_dump(mode="json"))
    assert flat["train.lr"] == "0.001"
    assert flat["engine.speculative.num_steps"] == "3"
    assert all(isinstance(v, str) for v in flat.values())


def test_activation_checkpointing_trains_the_same_under_deepspeed(tmp_path, monkeypatch):
    """Per-step recomputation inside DeepSpeed's engine (ZeRO-1, the default stage): the same losses over a few
    optimizer steps as without it. One process, gloo."""
    import deepspeed
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_RANK", "0")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'process-group'}", rank=0, world_size=1)
    train_cfg = load_config(None, ["train.micro_batch_size=2", "train.zero_stage=1"]).train
    d2t, t2d = _vocab()
    head = TargetHead(torch.randn(TARGET_VOCAB, HIDDEN), torch.randn(TARGET_VOCAB, HIDDEN))
    batch = collate(_samples())
    losses = {}
    try:
        for checkpointed in (False, True):
            torch.manual_seed(0)
            drafter = build_drafter(_drafter_config(), head, d2t, t2d)
            objective = TTTObjective(drafter, steps=3, decay=0.8, loss="soft", checkpointed=checkpointed)
            optimizer = torch.optim.AdamW(objective.parameters(), lr=1e-2)
            engine, _, _, _ = deepspeed.initialize(
                model=objective, optimizer=optimizer, config=deepspeed_config(train_cfg), dist_init_required=False
            )
            losses[checkpointed] = []
            for _ in range(3):
                loss, _ = engine(*objective_inputs(batch, head, t2d, torch.float32))
                engine.backward(loss)
                engine.step()
                losses[checkpointed].append(float(loss))
    finally:
        dist.destroy_process_group()
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert losses[True][-1] < losses[True][0]


class _StagingEngine:
    """Stands in for DeepSpeed's engine: save_checkpoint writes one file, or fails like a full disk."""

    def __init__(self, error_number: int | None = None):
        self.error_number = error_number
        self.module = SimpleNamespace(drafter=None)  # rank 1 does not save the drafter

    def save_checkpoint(self, directory, tag):
        if self.error_number is not None:
            raise OSError(self.error_number, os.strerror(self.error_number))
        os.makedirs(os.path.join(directory, tag))
        open(os.path.join(directory, tag, "state.pt"), "wb").close()


def _staging_dirs() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("draftline-ckpt-rank1-")}


@pytest.mark.parametrize("where", ["upload", "staging"])
def test_a_full_disk_while_checkpointing_is_one_line_naming_the_place_and_the_setting(tmp_path, monkeypatch, where):
    """ENOSPC while Ray Train copied a checkpoint to its storage (or while DeepSpeed staged it in TMPDIR) left the
    worker with a bare OSError, which Ray Train retries as a crash; now StorageFullError with one line."""
    import ray.train

    def upload_fails(metrics, checkpoint):
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(ray.train, "report", upload_fails)
    engine = _StagingEngine(errno.ENOSPC if where == "staging" else None)
    before = _staging_dirs()
    with pytest.raises(StorageFullError) as raised:
        save_and_report(engine, {"step": 3}, {"step": 3}, rank=1, zero_stage=0,
                        checkpoint_location=str(tmp_path / "ck"))
    message = str(raised.value)
    assert "\n" not in message
    if where == "upload":
        assert re.match(rf"cannot write {tmp_path}/ck: No space left on device \(\d+\.\d MB free there\); free "
                        r"space or point train.storage_uri \(or data_dir\) at a writable disk with room, then rerun: "
                        r"training resumes from the last complete checkpoint$", message), message
    else:
        assert re.match(rf"cannot write {tempfile.gettempdir()}/draftline-ckpt-rank1-\w+: No space left on device .*"
                        r"point TMPDIR at a writable disk with room, then rerun$", message), message
    assert _staging_dirs() == before, "the staged checkpoint must be removed"


def test_train_init_from_starts_from_every_weight_of_an_export_and_refuses_another_shape_or_vocab(tmp_path):
    """train.init_from (what draftline refresh continues from): the worker loads the export's weights; the driver
    refuses a drafter of another shape or draft vocab, naming the field and the fix."""
    head = TargetHead(torch.randn(TARGET_VOCAB, HIDDEN), torch.randn(TARGET_VOCAB, HIDDEN))
    d2t, t2d = _vocab()
    trained = build_drafter(_drafter_config(), head, d2t, t2d)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(torch.randn_like(parameter))
    export_dir = export_drafter(trained, tmp_path / "champion")

    fresh = build_drafter(_drafter_config(), head, d2t, t2d)
    start_from_export(fresh, str(export_dir))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in trained.state_dict().items())

    cfg = load_config("configs/tiny-cpu.yaml", [f"train.init_from={export_dir}"])
    check_init_from(cfg, _drafter_config(), d2t, t2d)
    wider = DrafterConfig(**{**_drafter_config().__dict__, "intermediate_size": 64})
    with pytest.raises(ConfigError, match=r"train.init_from=.*another shape: intermediate_size 32 \(this run: 64\)"):
        check_init_from(cfg, wider, d2t, t2d)
    other_t2d = t2d.roll(1)
    other_d2t = torch.nonzero(other_t2d).flatten() - torch.arange(DRAFT_VOCAB)
    with pytest.raises(ConfigError, match="another draft vocab.*data.draft_vocab_file"):
        check_init_from(cfg, _drafter_config(), other_d2t, other_t2d)
