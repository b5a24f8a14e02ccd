"""One training worker (Ray Train + DeepSpeed): TTT steps, validation, checkpoints, rank-0 MLflow logging.

Every attempt starts in `train_loop_per_worker`. With a Ray Train checkpoint present (a restart after a failure, or a
rerun of the same training) the worker loads DeepSpeed's state (weights, optimizer, scheduler), the step counter,
the best validation score and its RNG states from it, and continues: the sample order is a function of the step
(draftline.train.order), so nothing else needs restoring.

A checkpoint is reported at every `checkpoint_every` steps, at the last step, and whenever a validation beats the
best so far; each checkpoint carries fresh validation metrics of the weights it holds, so Ray's
`checkpoint_score_attribute=val_est_accept_len` ranks checkpoints by what they contain.
"""

from __future__ import annotations

import functools
import json
import math
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from draftline.drafter.export import load_drafter, save_drafter_checkpoint
from draftline.drafter.model import DrafterConfig, Eagle3Drafter
from draftline.drafter.ttt import est_accept_len, ttt_loss
from draftline.extract.online import stream_dataset_name
from draftline.faults import Fault
from draftline.train.data import Batch, ShardSamples, TargetHead, collate, load_target_head
from draftline.train.deepspeed_ops import ensure_shm_comm_op
from draftline.train.job import TrainingJob
from draftline.train.order import is_checkpoint_step, is_validation_step
from draftline.train.stream import StreamReader
from draftline.utils import StorageFullError, raise_if_storage_full

DEEPSPEED_TAG = "deepspeed"
TRAIN_STATE_FILE = "train_state.json"
DRAFTER_SUBDIR = "drafter"
RNG_SUBDIR = "rng"
SCORE_METRIC = "val_est_accept_len"

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _log(msg: str) -> None:
    print(f"[train] {msg}", flush=True)


class TTTObjective(nn.Module):
    """The drafter plus its training-time-test loss, so DeepSpeed's engine forward is the whole objective."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, loss: str, checkpointed: bool = True,
                 attention: str = "fused"):
        super().__init__()
        self.drafter = drafter
        self.steps, self.decay, self.loss, self.checkpointed = steps, decay, loss, checkpointed
        self.attention = attention

    def forward(self, input_embeds, aux_hidden, target_logits_draft, loss_mask, target_ids, attention_mask,
                document_ids=None):
        return ttt_loss(
            self.drafter,
            input_embeds,
            aux_hidden,
            target_logits_draft,
            loss_mask,
            target_ids=target_ids,
            attention_mask=attention_mask,
            document_ids=document_ids,
            steps=self.steps,
            decay=self.decay,
            loss=self.loss,
            attention=self.attention,
            checkpointed=self.checkpointed,
        )


def objective_for(drafter: Eagle3Drafter, train_cfg: Any) -> TTTObjective:
    """The objective as `train_cfg` (the config's train section) asks for it."""
    return TTTObjective(
        drafter, train_cfg.ttt_steps, train_cfg.ttt_decay, train_cfg.loss, train_cfg.activation_checkpointing,
        train_cfg.attention,
    )


def batch_maker(train_cfg: Any):
    """samples -> Batch as `train_cfg` asks: one sample a row, or packed."""
    return functools.partial(collate, packing=train_cfg.packing, row_tokens=train_cfg.packed_row_tokens)


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, floor: float = 0.1) -> float:
    """Linear warmup to 1, then cosine decay to `floor` at max_steps (step is 0-based, as the scheduler counts)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def deepspeed_config(train_cfg: Any) -> dict:
    return {
        "train_micro_batch_size_per_gpu": train_cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": train_cfg.grad_clip,
        "zero_optimization": {"stage": train_cfg.zero_stage},
        # ZeRO wraps our torch AdamW (a non-fused optimizer that also runs on CPU); DeepSpeed asks to confirm that.
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": train_cfg.dtype == "bfloat16"},
        "steps_per_print": 1 << 30,
    }


class StepMetrics:
    """Sums over ranks and batches of (loss_k * count_k, hits_k, count_k, total loss, batches, real tokens, positions
    computed, positions one sample a row would compute), turned into averages once all-reduced."""

    def __init__(self, steps: int):
        self.steps = steps
        self.sums = torch.zeros(3 * steps + 5, dtype=torch.float64)

    def add(self, total_loss: float, metrics: dict[str, float], tokens: int = 0, slots: int = 0,
            unpacked_slots: int = 0) -> None:
        """`tokens` real tokens of the batch, `slots` positions it computed, `unpacked_slots` those of one sample a
        row."""
        for k in range(self.steps):
            count = metrics[f"count_{k}"]
            self.sums[k] += metrics[f"loss_{k}"] * count
            self.sums[self.steps + k] += metrics[f"acc_{k}"] * count
            self.sums[2 * self.steps + k] += count
        self.sums[-5] += total_loss
        self.sums[-4] += 1
        self.sums[-3] += tokens
        self.sums[-2] += slots
        self.sums[-1] += unpacked_slots

    def merge(self, other: "StepMetrics") -> None:
        self.sums += other.sums

    @property
    def tokens(self) -> int:
        return int(self.sums[-3])

    def padding(self) -> dict[str, float]:
        """Fractions of the positions computed that were padding: as trained, and with one sample a row."""
        tokens, slots, unpacked = self.sums[-3:].tolist()
        return {"padding_fraction": 1 - tokens / max(slots, 1), "padding_fraction_unpacked": 1 - tokens / max(unpacked, 1)}

    def all_reduce(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.sums, op=dist.ReduceOp.SUM)

    def averages(self, prefix: str = "") -> dict[str, float]:
        steps, sums = self.steps, self.sums.tolist()
        out: dict[str, float] = {f"{prefix}loss": sums[-5] / max(sums[-4], 1)}
        accs = []
        for k in range(steps):
            count = sums[2 * steps + k]
            out[f"{prefix}loss_{k}"] = sums[k] / count if count else 0.0
            accs.append(sums[steps + k] / count if count else 0.0)
            out[f"{prefix}acc_{k}"] = accs[-1]
        out[f"{prefix}est_accept_len"] = est_accept_len(accs)
        return out


def objective_inputs(batch: Batch, head: TargetHead, t2d: torch.Tensor, dtype: torch.dtype) -> tuple:
    """Frozen-target inputs for the TTT objective: embeddings of the tokens, target logits over the draft vocab and
    the target's argmax ids (from the full vocab, never held whole)."""
    with torch.no_grad():
        input_embeds = head.embed(batch.input_ids).to(dtype)
        target_logits_draft, target_ids = head.draft_signals(batch.final_hidden, t2d)
    return (
        input_embeds,
        batch.aux_hidden,
        target_logits_draft,
        batch.loss_mask,
        target_ids,
        batch.attention_mask,
        batch.document_ids,
    )


def validate(engine, val_batches, head: TargetHead, t2d, device, dtype, steps, make_batch=collate):
    """Val metrics over the whole val split, each rank taking a contiguous slice (`val_batches`: its micro-batches
    of samples, made into batches by `make_batch`); summed across ranks."""
    totals = StepMetrics(steps)
    engine.eval()
    with torch.no_grad():
        for samples in val_batches:
            batch = make_batch(samples).to(device, dtype)
            loss, metrics = engine(*objective_inputs(batch, head, t2d, dtype))
            totals.add(float(loss), metrics)
    engine.train()
    totals.all_reduce()
    return totals.averages(prefix="val_")


class MetricsLogger:
    """Rank 0's MLflow writer: per-step metrics into the run the driver created, sent in batches."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, enabled: bool):
        self.enabled = bool(enabled and tracking_uri and run_id)
        self.run_id = run_id
        self.buffer: list = []
        if self.enabled:
            from mlflow import MlflowClient

            self.client = MlflowClient(tracking_uri=tracking_uri)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.buffer.extend(Metric(key, float(value), now_ms, step) for key, value in metrics.items())

    def flush(self) -> None:
        if self.enabled and self.buffer:
            for start in range(0, len(self.buffer), 1000):  # MLflow caps a batch at 1000 metrics
                self.client.log_batch(self.run_id, metrics=self.buffer[start : start + 1000], synchronous=True)
            self.buffer = []


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_drafter_weights(engine, directory: Path, rank: int, zero_stage: int) -> None:
    """Rank 0 writes the drafter alone (drafter_state.pt + drafter_config.json) for export_from_checkpoint."""
    drafter = engine.module.drafter
    if zero_stage == 3:
        import deepspeed

        # ZeRO-3 partitions parameters: gather them on every rank, rank 0 saves.
        with deepspeed.zero.GatheredParameters(list(drafter.parameters()), modifier_rank=None):
            if rank == 0:
                save_drafter_checkpoint(drafter, directory)
    elif rank == 0:
        save_drafter_checkpoint(drafter, directory)


def save_and_report(engine, state: dict, metrics: dict, rank: int, zero_stage: int, checkpoint_location: str) -> None:
    """DeepSpeed state (every rank writes its part) + train state + RNG + drafter weights, staged in a local temp
    directory, then reported to Ray Train, which copies it to `checkpoint_location` (a full disk: StorageFullError)."""
    import ray.train

    with raise_if_storage_full(tempfile.gettempdir(), "TMPDIR"):
        local_dir = Path(tempfile.mkdtemp(prefix=f"draftline-ckpt-rank{rank}-"))
    try:
        with raise_if_storage_full(local_dir, "TMPDIR"):
            engine.save_checkpoint(str(local_dir), tag=DEEPSPEED_TAG)
            (local_dir / RNG_SUBDIR).mkdir(exist_ok=True)
            torch.save(_rng_state(), local_dir / RNG_SUBDIR / f"rank_{rank}.pt")
            save_drafter_weights(engine, local_dir / DRAFTER_SUBDIR, rank, zero_stage)
            if rank == 0:
                (local_dir / TRAIN_STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        with raise_if_storage_full(checkpoint_location, "train.storage_uri (or data_dir)",
                                   "training resumes from the last complete checkpoint"):
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(local_dir)))
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


def restore(engine, checkpoint, rank: int) -> dict:
    """Load DeepSpeed state, RNG and the train state from a Ray Train checkpoint; returns the train state."""
    with checkpoint.as_directory() as directory:
        directory = Path(directory)
        load_path, _ = engine.load_checkpoint(str(directory), tag=DEEPSPEED_TAG)
        if load_path is None:
            raise RuntimeError(f"checkpoint {directory} has no DeepSpeed state under tag {DEEPSPEED_TAG!r}")
        state = json.loads((directory / TRAIN_STATE_FILE).read_text())
        rng_path = directory / RNG_SUBDIR / f"rank_{rank}.pt"
        if rng_path.is_file():  # absent when resuming with more workers than before
            _set_rng_state(torch.load(rng_path, weights_only=False))
    return state


def wait_for_committed_checkpoints() -> None:
    """Block until Ray Train has registered every checkpoint reported so far (the controller collects reports by
    polling; a worker that dies before the poll loses the checkpoint it just reported)."""
    import ray.train

    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


def fire_fault(fault: Fault | None, step: int, rank: int, world_size: int,
               wait_for_checkpoints=wait_for_committed_checkpoints) -> None:
    """The "train.step" fault (draftline.faults) on the last rank, after the checkpoints reported before are
    committed, so a test checks resume from a known checkpoint."""
    if fault is not None and rank == world_size - 1:
        fault.fire(step, f"rank {rank}", before=wait_for_checkpoints)


def build_drafter(drafter_config: DrafterConfig, head: TargetHead, d2t: torch.Tensor, t2d: torch.Tensor,
                  init_norm_from_target: bool = False) -> Eagle3Drafter:
    drafter = Eagle3Drafter(drafter_config)
    drafter.set_vocab(d2t, t2d)
    with torch.no_grad():
        # Start the draft lm_head as the target's own rows for the draft vocab: the drafter's first job is to
        # predict what the target predicts, and this head already maps target-like states to target logits.
        drafter.lm_head.weight.copy_(head.lm_head_weight[t2d.bool()].to(drafter.lm_head.weight.dtype))
        if init_norm_from_target:
            drafter.norm.weight.copy_(target_final_norm(head, drafter).to(drafter.norm.weight.dtype))
    return drafter


def start_from_export(drafter: Eagle3Drafter, export_dir: str) -> None:
    """train.init_from: every weight (and the draft vocab) of a drafter export, cast to the drafter's dtype; the
    driver checked that its shape and vocab are this run's (train/run.py check_init_from)."""
    with torch.no_grad():
        drafter.load_state_dict(load_drafter(export_dir).state_dict(), strict=True)


def target_final_norm(head: TargetHead, drafter: Eagle3Drafter) -> torch.Tensor:
    """The target's final norm weight, which scales what its lm_head (the drafter's starting head) reads."""
    width = drafter.norm.weight.shape[0]
    if head.final_norm_weight is None or head.final_norm_weight.shape[0] != width:
        found = None if head.final_norm_weight is None else tuple(head.final_norm_weight.shape)
        raise ValueError(f"train.init_norm_from_target: the target's final norm weight is {found}, the drafter's norm "
                         f"has width {width}; set train.init_norm_from_target=false")
    return head.final_norm_weight


def worker_samples(job: TrainingJob, rank: int, world_size: int, resume_step: int):
    """Where this worker's samples come from: the shards (offline), or its stream of the target's states (online),
    which starts after `resume_step` (draftline.train.stream)."""
    cfg, online = job.cfg, job.online
    if online is None:
        return ShardSamples(job.train_location, job.val_location, rank, world_size, cfg.train.micro_batch_size, cfg.seed)
    import ray
    import ray.train

    # Before the first read: the stream's first stage drops the rows of the steps already trained.
    ray.get(online.cursor.set_start.remote(rank, resume_step))
    return StreamReader(
        ray.train.get_dataset_shard(stream_dataset_name(rank)), rank, world_size, cfg.train.micro_batch_size,
        online.shard_sizes, online.num_val_samples, cfg.seed, cfg.extract.dtype, cfg.extract.online.prefetch_blocks,
    )  # fmt: skip


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point (one per worker; every attempt after a failure starts here again).

    A full disk is not a crash to retry: the rank that hits it tells the driver's StorageFullSink and fails; Ray
    Train (which retries every worker error) starts the group again, and the new workers, seeing the message, return
    at once without training; the driver then raises the message."""
    import ray
    import ray.train

    job = TrainingJob.from_loop_config(loop_config)
    sink = job.storage_full_sink
    if sink is not None and ray.get(sink.messages.remote()):
        return
    try:
        _train(job)
    except StorageFullError as err:
        if sink is not None:
            ray.get(sink.add.remote(str(err)))
        raise


def _train(job: TrainingJob) -> None:
    import deepspeed
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    cfg = job.cfg
    train_cfg = cfg.train
    dtype = _TORCH_DTYPES[train_cfg.dtype]
    if train_cfg.use_gpu:
        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, int(train_cfg.cpus_per_worker)))
    torch.manual_seed(cfg.seed)

    d2t, t2d = job.d2t, job.t2d
    head = load_target_head(job.target_dir).to(device, dtype)
    t2d_device = t2d.to(device)

    drafter = build_drafter(job.drafter_config, head, d2t, t2d, cfg.train.init_norm_from_target)
    if cfg.train.init_from:
        start_from_export(drafter, cfg.train.init_from)
    objective = objective_for(drafter, train_cfg)
    make_batch = batch_maker(train_cfg)
    optimizer = torch.optim.AdamW(
        objective.parameters(), lr=train_cfg.lr, weight_decay=train_cfg.weight_decay, betas=(0.9, 0.95)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, train_cfg.warmup_steps, train_cfg.max_steps)
    )
    ensure_shm_comm_op()
    engine, _, _, _ = deepspeed.initialize(
        model=objective, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(train_cfg)
    )

    state = {"step": 0, "best_val_est_accept_len": None, "best_step": None, "resumes": 0, "tokens_seen": 0}
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        state = restore(engine, checkpoint, rank)
        state["resumes"] += 1
        _log(f"rank {rank}: resumed from step {state['step']} (resume #{state['resumes']})")
    logger = MetricsLogger(job.tracking_uri, job.run_id, enabled=rank == 0)
    if checkpoint is not None:
        logger.log({"resumed_at_step": state["step"]}, step=state["step"])

    samples = worker_samples(job, rank, world_size, resume_step=state["step"])
    attempt_totals = StepMetrics(train_cfg.ttt_steps)  # padding over this attempt's steps, all ranks
    while state["step"] < train_cfg.max_steps:
        fire_fault(job.fault, state["step"] + 1, rank, world_size)
        started, started_cpu = time.perf_counter(), time.process_time()
        batch = make_batch(samples.train_samples(state["step"])).to(device, dtype)
        loss, metrics = engine(*objective_inputs(batch, head, t2d_device, dtype))
        engine.backward(loss)
        engine.step()
        state["step"] += 1
        step = state["step"]

        step_totals = StepMetrics(train_cfg.ttt_steps)
        step_totals.add(
            float(loss.detach()), metrics, batch.num_tokens, batch.num_slots, batch.unpacked_slots or batch.num_slots
        )
        step_totals.all_reduce()
        attempt_totals.merge(step_totals)
        global_tokens = step_totals.tokens
        step_s = time.perf_counter() - started
        # This process's CPU time (all its threads): a shared machine's load inflates it far less than step_s.
        step_cpu_s = time.process_time() - started_cpu
        state["tokens_seen"] += global_tokens
        step_metrics = {
            **step_totals.averages(),
            **step_totals.padding(),
            "lr": scheduler.get_last_lr()[0],
            "tokens_per_s": global_tokens / step_s,
            "tokens_per_s_per_worker": global_tokens / step_s / world_size,
            "step_s": step_s,
            "step_cpu_s": step_cpu_s,
            "tokens_per_cpu_s": batch.num_tokens / max(step_cpu_s, 1e-9),  # this rank's real tokens, its own CPU
            "tokens_seen": state["tokens_seen"],
        }
        if getattr(samples, "tokens_received", 0):
            step_metrics["streamed_bytes_per_token"] = samples.bytes_per_token
        logger.log(step_metrics, step)

        if is_validation_step(step, train_cfg):
            val_metrics = validate(
                engine, samples.val_batches(step), head, t2d_device, device, dtype, train_cfg.ttt_steps, make_batch
            )
            score = val_metrics[SCORE_METRIC]
            improved = state["best_val_est_accept_len"] is None or score > state["best_val_est_accept_len"]
            if improved:
                state["best_val_est_accept_len"], state["best_step"] = score, step
            logger.log({**val_metrics, "best_val_est_accept_len": state["best_val_est_accept_len"]}, step)
            if rank == 0:
                _log(
                    f"step {step}/{train_cfg.max_steps} loss {step_metrics['loss']:.3f} acc_0 "
                    f"{step_metrics['acc_0']:.3f} | val acc_0 {val_metrics['val_acc_0']:.3f} "
                    f"est_accept_len {score:.3f} | {step_metrics['tokens_per_s']:.0f} tokens/s, padding "
                    f"{step_metrics['padding_fraction']:.1%} (one sample a row: "
                    f"{step_metrics['padding_fraction_unpacked']:.1%})"
                )
            if improved or is_checkpoint_step(step, train_cfg):
                logger.flush()  # metrics up to a checkpoint are in MLflow before the checkpoint exists
                report = {**val_metrics, "step": step, "tokens_seen": state["tokens_seen"]}
                save_and_report(engine, state, report, rank, train_cfg.zero_stage, job.checkpoint_location)
        if step % train_cfg.log_every == 0:
            logger.flush()
    if attempt_totals.tokens:
        padding = attempt_totals.padding()
        logger.log({f"run_{name}": value for name, value in padding.items()}, state["step"])
        if rank == 0:
            _log(
                f"padding over {attempt_totals.tokens} real tokens: {padding['padding_fraction']:.1%} of the positions "
                f"computed ({'packed' if train_cfg.packing else 'one sample a row'}); one sample a row: "
                f"{padding['padding_fraction_unpacked']:.1%}"
            )
    logger.flush()
