"""Online mode (`extract.mode: online`): the target runs beside training and streams what the drafter is fed.

Each training worker (rank r of W) gets its own Ray Data dataset, `online_rank<r>` (passed to the TorchTrainer,
not split: `DataConfig(datasets_to_split=[])`), read with `ray.train.get_dataset_shard`:

    rows (split, step, sample_index) in training order
      ->  map_batches(TargetCapture, compute=ActorPoolStrategy(size=extract.online.actors_per_train_worker))
      ->  the worker

The rows are the samples rank r would read from the shards offline, in the same order, as training defines it
(`draftline.train.order.rank_stream_rows`, computed by the training driver and handed to `build_streams`): step s's
micro-batch with the shard sizes offline extraction would write (`extract.samples_per_shard`), followed, at a
validation step, by the rank's contiguous val slice. Order is kept
(`ExecutionOptions(preserve_order=True)`), so the worker collates the same micro-batches as offline and the loss,
metrics and checkpoints are the same code (tests/e2e/test_train_online.py compares the per-step losses).

TargetCapture holds the whole target (`extract.cpus_per_worker` CPUs, one GPU with `extract.use_gpu`; or, with
`extract.pipeline`, drives a pipeline of stage actors) and runs the one capture function of offline extraction
(`worker.hidden_states_for_samples` -> `capture_aux_hidden`), in `extract.batch_size` samples per forward, cast to
`extract.dtype`. Its output blocks go through Ray's object store to the worker; nothing is written to disk.
Backpressure: each stream's executor may hold `extract.online.object_store_memory_mb` of blocks
(`ExecutionOptions.resource_limits.object_store_memory`); when training lags, the actors stop being fed.

Failures. A target actor that dies is restarted by Ray Data (max_restarts=-1) and its batch retried
(max_task_retries=-1): same rows, same order. A training worker that dies makes Ray Train restart the group from the
last checkpoint at step s; each new worker tells the `StreamCursor` actor its s before it starts reading, and the
target actors drop the rows of steps <= s before their forward (no forward is spent on them). The worker's reader
(`draftline.train.stream.StreamReader`) checks every row it takes against the order it expects, so a lost or repeated
sample cannot go unseen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from draftline import faults
from draftline.extract.job import CaptureJob
from draftline.extract.run import aux_layer_ids_for, target_info
from draftline.extract.shards import TORCH_DTYPES, num_shards, shard_sample_range, stored_bytes_per_token
from draftline.extract.worker import hidden_states_for_samples, load_capture_model
from draftline.utils import actor_on_driver_node, read_json

TRAIN, VAL = 0, 1
PAYLOAD = ("input_ids", "loss_mask", "aux_hidden", "final_hidden")


def stream_dataset_name(rank: int) -> str:
    return f"online_rank{rank}"


def shard_sizes_for(num_samples: int, samples_per_shard: int) -> list[int]:
    """The shard sizes offline extraction writes for a split; the training order is defined over them."""
    return [len(shard_sample_range(i, num_samples, samples_per_shard)) for i in range(num_shards(num_samples, samples_per_shard))]


def streamed_bytes_per_token(num_aux: int, hidden_size: int, dtype: str) -> int:
    """What the stream carries per token: the same tensors a shard stores (aux + final states, token id, mask)."""
    return stored_bytes_per_token(num_aux, hidden_size, dtype)


class StreamCursor:
    """Ray actor: the step each rank resumed at (0 on a fresh start). Set by the worker before it reads its stream;
    read by the target actors, which drop rows of steps already trained."""

    def __init__(self):
        self.starts: dict[int, int] = {}

    def set_start(self, rank: int, step: int) -> None:
        self.starts[rank] = step

    def start(self, rank: int) -> int:
        return self.starts.get(rank, 0)


def to_wire(tensor: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: such tensors travel as their int16 bit pattern (`from_wire` views them back)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.contiguous().numpy()


def from_wire(array: np.ndarray, dtype: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array))  # a copy: blocks from the object store are read-only
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def _object_column(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """One ragged column (samples differ in length): an object array, which Ray Data stores as a variable-shaped
    tensor column."""
    column = np.empty(len(arrays), dtype=object)
    for row, array in enumerate(arrays):
        column[row] = array
    return column


class TargetCapture:
    """Ray Data actor: holds the target and turns rows (split, step, sample_index) into the samples training reads."""

    def __init__(self, job: CaptureJob):
        import ray

        cfg, rank = job.cfg, job.rank
        self.plan = job.plan
        self.device = torch.device("cuda" if cfg.extract.use_gpu and cfg.extract.pipeline is None else "cpu")
        self.model = load_capture_model(cfg, job.plan, self.device, f"online target actor pid {os.getpid()}",
                                        slot=f"rank{rank}-{ray.get_runtime_context().get_actor_id() or os.getpid()}")
        self.split_tokens = {split: ray.get(ref) for split, ref in job.split_tokens_refs.items()}
        self.cursor, self.rank = job.cursor, rank
        self.fault = job.fault
        self.batches_done = 0

    def __call__(self, batch: dict) -> dict:
        import ray

        # Rows of steps a resumed worker already trained on are dropped before the forward.
        keep = batch["step"] > ray.get(self.cursor.start.remote(self.rank))
        batch = {name: column[keep] for name, column in batch.items()}
        plan = self.plan
        tokens = [self.split_tokens[int(split)].sample(int(i)) for split, i in zip(batch["split"], batch["sample_index"])]
        hidden = hidden_states_for_samples(
            self.model, [ids for ids, _ in tokens], plan["aux_layer_ids"], plan["batch_size"], plan["pad_id"],
            TORCH_DTYPES[plan["dtype"]], self.device,
        )  # fmt: skip
        self.batches_done += 1
        if self.fault is not None:
            self.fault.fire(self.batches_done, f"online target actor of rank {self.rank}")
        return {
            "split": batch["split"],
            "step": batch["step"],
            "sample_index": batch["sample_index"],
            "input_ids": _object_column([ids.numpy() for ids, _ in tokens]),
            "loss_mask": _object_column([mask.numpy() for _, mask in tokens]),
            "aux_hidden": _object_column([to_wire(aux) for aux, _ in hidden]),
            "final_hidden": _object_column([to_wire(final) for _, final in hidden]),
        }


@dataclass
class OnlineStreams:
    """The driver's side: one dataset per training rank, the DataConfig that keeps them in order and bounded, and
    the cursor actor."""

    datasets: dict
    data_config: object
    cursor: object


def build_streams(cfg, plan: dict, split_tokens: dict, rows_per_rank: list[list[dict]]) -> OnlineStreams:
    """`split_tokens`: {TRAIN: SplitTokens, VAL: SplitTokens}; `rows_per_rank`: each training rank's rows (split,
    step, sample_index) in the order it reads them (train/order.py). Nothing runs until a worker iterates its
    stream."""
    import ray
    import ray.data
    from ray.data import ExecutionOptions, ExecutionResources
    from ray.train import DataConfig

    extract_cfg = cfg.extract
    cursor = actor_on_driver_node(StreamCursor)
    refs = {split: ray.put(tokens) for split, tokens in split_tokens.items()}
    resources = {"num_cpus": extract_cfg.cpus_per_worker, "num_gpus": 1 if extract_cfg.use_gpu else 0}
    if extract_cfg.pipeline is not None:  # the stage actors hold the devices; this actor only drives them
        resources["num_gpus"] = 0
    datasets = {}
    for rank, rows in enumerate(rows_per_rank):
        datasets[stream_dataset_name(rank)] = (
            ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // extract_cfg.batch_size)))
            .map_batches(
                TargetCapture,
                fn_constructor_kwargs={"job": CaptureJob(cfg, plan, refs, cursor, rank, faults.planned("online.batches"))},
                compute=ray.data.ActorPoolStrategy(size=extract_cfg.online.actors_per_train_worker),
                batch_size=extract_cfg.batch_size,
                batch_format="numpy",
                # A dead target actor is restarted and its batch retried: Ray Data's actor-pool defaults
                # (max_restarts=-1, max_task_retries=-1; passing them is deprecated in Ray 2.60). The killed-actor
                # test in tests/e2e/test_train_online.py fails with max_restarts=0 here.
                **resources,
            )
        )
    options = ExecutionOptions(
        preserve_order=True,
        resource_limits=ExecutionResources.for_limits(
            object_store_memory=int(extract_cfg.online.object_store_memory_mb * 2**20)
        ),
    )
    return OnlineStreams(datasets, DataConfig(datasets_to_split=[], execution_options=options), cursor)


def online_extract_summary(cfg, target_dir, dataset_dir) -> dict:
    """What `draftline extract` and the extract stage of `draftline run` print in online mode, before training
    starts: nothing on disk, the bytes per token the stream will carry and their total per epoch of the prepared
    dataset (train + val tokens; each epoch runs the target again)."""
    target = target_info(cfg, Path(target_dir))
    aux_layer_ids = aux_layer_ids_for(cfg, target)
    per_token = streamed_bytes_per_token(len(aux_layer_ids), target.hidden_size, cfg.extract.dtype)
    tokens = sum(read_json(Path(dataset_dir) / "report.json")["tokens"][split] for split in ("train", "val"))
    line = (
        f"[extract] online: 0 bytes on disk (no shards); training streams {per_token} bytes per token of aux layers "
        f"{aux_layer_ids} from target actors through Ray's object store, {per_token * tokens / 1e9:.3f} GB per epoch "
        f"of the {tokens} train + val tokens"
    )
    return {"line": line, "bytes_per_token": per_token, "aux_layer_ids": aux_layer_ids, "tokens": tokens}
