"""One extraction worker: load the target, run batched forwards, write the shards this rank owns.

Runs inside a Ray Train worker (`extract_loop_per_worker`); the per-shard functions are plain functions so tests
can call them in-process.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from draftline.extract.job import ExtractionJob
from draftline.extract.shards import (
    TORCH_DTYPES,
    EncodedShard,
    complete_shard_record,
    encode_shard,
    num_shards,
    shard_sample_range,
    shards_of_worker,
    write_shard,
)
from draftline.extract.storage import Storage
from draftline.faults import Fault
from draftline.target.capture import capture_aux_hidden
from draftline.target.load import load_target
from draftline.target.stages import PipelinedTarget
from draftline.utils import StorageFullError


@dataclass
class SplitTokens:
    """A split's token ids and loss masks as flat arrays (cheap to put in Ray's object store once for all workers)."""

    input_ids: np.ndarray  # int64 [total_tokens]
    loss_mask: np.ndarray  # uint8 [total_tokens]
    offsets: np.ndarray  # int64 [num_samples + 1]

    @classmethod
    def from_samples(cls, samples: Sequence[dict]) -> "SplitTokens":
        lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        input_ids = np.fromiter((t for s in samples for t in s["input_ids"]), dtype=np.int64, count=int(offsets[-1]))
        loss_mask = np.fromiter((m for s in samples for m in s["loss_mask"]), dtype=np.uint8, count=int(offsets[-1]))
        return cls(input_ids=input_ids, loss_mask=loss_mask, offsets=offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return torch.from_numpy(self.input_ids[start:end].copy()), torch.from_numpy(self.loss_mask[start:end].copy())

    @property
    def total_tokens(self) -> int:
        return int(self.offsets[-1])


def right_padded_batch(sequences: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token id sequences with padding on the right; mask is 1 on real tokens."""
    longest = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.int64)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = sequence
        attention_mask[row, : len(sequence)] = 1
    return input_ids, attention_mask


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices batched longest-first, so each batch pads little."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def hidden_states_for_samples(
    model,
    sequences: Sequence[torch.Tensor],
    aux_layer_ids: Sequence[int],
    batch_size: int,
    pad_id: int,
    out_dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(aux_hidden [T, n_aux*H], final_hidden [T, H]) per sequence, in input order, on CPU in `out_dtype`.

    Right padding keeps every real token at the same positions (and the same causal context) as when it runs alone.
    """
    results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(sequences)
    batches = length_sorted_batches([len(s) for s in sequences], batch_size)
    padded = (right_padded_batch([sequences[i] for i in batch_indices], pad_id) for batch_indices in batches)
    for batch_indices, (aux_hidden, final_hidden) in zip(batches, _captured(model, padded, aux_layer_ids, device)):
        aux_hidden = aux_hidden.to("cpu", out_dtype)
        final_hidden = final_hidden.to("cpu", out_dtype)
        for row, index in enumerate(batch_indices):
            length = len(sequences[index])
            results[index] = (aux_hidden[row, :length], final_hidden[row, :length])
    return results  # type: ignore[return-value]


def _captured(model, padded_batches, aux_layer_ids: Sequence[int], device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(aux_hidden, final_hidden) per batch, in order. `model` is an HF causal LM in this process (batches run one
    by one) or a `PipelinedTarget` (extract.pipeline: several batches in flight through its stage actors)."""
    if isinstance(model, PipelinedTarget):
        if model.aux_layer_ids != list(aux_layer_ids):
            raise ValueError(f"the pipeline captures aux layers {model.aux_layer_ids}, the plan asks for {list(aux_layer_ids)}")
        yield from model.capture_many(padded_batches)
        return
    for input_ids, attention_mask in padded_batches:
        yield capture_aux_hidden(model, input_ids.to(device), attention_mask.to(device), aux_layer_ids)


def extract_shard(
    model,
    split_tokens: SplitTokens,
    shard_index: int,
    samples_per_shard: int,
    aux_layer_ids: Sequence[int],
    batch_size: int,
    pad_id: int,
    out_dtype: torch.dtype,
    metadata: dict[str, str],
    device: torch.device | str = "cpu",
) -> EncodedShard:
    """Run the target over one shard's fixed sample range; return the encoded safetensors blob."""
    started, started_unix = time.perf_counter(), time.time()
    sample_range = shard_sample_range(shard_index, len(split_tokens), samples_per_shard)
    tokens_and_masks = [split_tokens.sample(i) for i in sample_range]
    hidden = hidden_states_for_samples(
        model, [ids for ids, _ in tokens_and_masks], aux_layer_ids, batch_size, pad_id, out_dtype, device
    )
    samples = [
        {"input_ids": ids, "loss_mask": mask, "aux_hidden": aux, "final_hidden": final}
        for (ids, mask), (aux, final) in zip(tokens_and_masks, hidden)
    ]
    blob, tokens = encode_shard(samples, list(sample_range), metadata)
    return EncodedShard(
        shard_index=shard_index,
        blob=blob,
        samples=len(sample_range),
        tokens=tokens,
        first_sample=sample_range.start,
        compute_s=round(time.perf_counter() - started, 4),
        started_unix=started_unix,
    )


def run_worker_shards(
    model,
    split_tokens: SplitTokens,
    storage: Storage,
    rank: int,
    world_size: int,
    plan: dict,
    device: torch.device | str = "cpu",
    fault: Fault | None = None,
) -> dict:
    """Write every shard this rank owns that is not already complete. Returns counts for the log.

    Checksumming and writing shard k (I/O, GIL released) overlap with the forward passes of shard k+1; at most one
    write is in flight, so memory stays at two shards. A full disk (or quota, or read-only file system) stops the
    worker at the first failed write and comes back as "storage_full", not raised: Ray Train would restart the worker
    group extract.max_failures times to fail the same way.
    """
    total_shards = num_shards(len(split_tokens), plan["samples_per_shard"])
    counts = {"rank": rank, "written": 0, "skipped": 0}
    pending: Future | None = None

    def wait_for_write() -> None:
        pending.result()
        counts["written"] += 1
        if fault is not None:
            fault.fire(counts["written"], f"extraction worker {rank}")

    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as writer:
            for shard_index in shards_of_worker(rank, world_size, total_shards):
                expected = len(shard_sample_range(shard_index, len(split_tokens), plan["samples_per_shard"]))
                if complete_shard_record(storage, shard_index, expected) is not None:
                    counts["skipped"] += 1
                    continue
                shard = extract_shard(
                    model,
                    split_tokens,
                    shard_index,
                    plan["samples_per_shard"],
                    plan["aux_layer_ids"],
                    plan["batch_size"],
                    plan["pad_id"],
                    TORCH_DTYPES[plan["dtype"]],
                    plan["shard_metadata"],
                    device,
                )
                if pending is not None:
                    wait_for_write()
                pending = writer.submit(write_shard, storage, shard)
            if pending is not None:
                wait_for_write()
    except StorageFullError as err:
        counts["storage_full"] = str(err)
    return counts


def load_capture_model(cfg, plan: dict, device: torch.device, who: str, slot: str):
    """What `_captured` runs: the target on `device` in this process, or (extract.pipeline) a `PipelinedTarget`
    whose stage actors hold it, its placement group named `<plan's stage_groups>-<slot>` (the driver removes the
    run's groups when it is done). Used by the offline extraction workers and the online target actors alike;
    either way the target files must have the fingerprint the driver saw."""
    torch.set_num_threads(max(1, int(cfg.extract.cpus_per_worker)))
    if cfg.extract.pipeline is not None:
        # This process drives one pipeline; its stage actors hold the target (and the GPUs), each checks the files.
        model = PipelinedTarget(
            plan["target_dir"], plan["aux_layer_ids"], cfg.extract.pipeline, cfg.target.dtype,
            cfg.target.trust_remote_code, plan["target_fingerprint"], group_name=f"{plan['stage_groups']}-{slot}",
        )  # fmt: skip
        print(f"[extract] {who}: pipeline stages {model.layout}", flush=True)
        return model
    target = load_target(cfg, device=str(device), target_dir=plan["target_dir"])
    if target.fingerprint != plan["target_fingerprint"]:
        raise RuntimeError(
            f"{who}: target at {plan['target_dir']} has fingerprint {target.fingerprint}, the driver saw "
            f"{plan['target_fingerprint']}; every node must have the same target files"
        )
    return target.model


def extract_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point (one per worker; every attempt after a failure starts here again)."""
    import ray
    import ray.train
    import ray.train.torch

    job = ExtractionJob.from_loop_config(loop_config)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    cfg = job.cfg
    device = ray.train.torch.get_device() if cfg.extract.use_gpu and cfg.extract.pipeline is None else torch.device("cpu")
    model = load_capture_model(cfg, job.plan, device, f"worker {rank}", slot=f"rank{rank}")
    try:
        _extract_splits_of_worker(model, job, rank, world_size, device)
    finally:
        if isinstance(model, PipelinedTarget):
            model.shutdown()


def _extract_splits_of_worker(model, job: ExtractionJob, rank: int, world_size: int, device) -> None:
    import ray

    plan = job.plan
    for split in job.splits:
        split_tokens: SplitTokens = ray.get(split.split_tokens_ref)
        split_plan = {**plan, "shard_metadata": {**plan["shard_metadata"], "split": split.split}}
        started = time.perf_counter()
        counts = run_worker_shards(
            model,
            split_tokens,
            Storage(split.location),
            rank,
            world_size,
            split_plan,
            device,
            job.fault,
        )
        print(
            f"[extract] worker {rank}/{world_size} {split.split}: wrote {counts['written']} shards, skipped "
            f"{counts['skipped']} complete ones in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
        if "storage_full" in counts:
            # Returning (not raising) ends this worker without a Ray Train retry; the driver raises the message.
            ray.get(job.storage_full_sink.add.remote(counts["storage_full"]))
            return
