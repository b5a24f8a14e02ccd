"""Stage 4 driver: check inputs, create the MLflow run, run the Ray Train worker group, export and register the best.

`train(cfg, hidden_dir, dataset_dir, target_dir) -> TrainResult`. The training hash covers the train config, the
seed, the target, the dataset and the hidden states. It names the Ray Train run (so a restarted driver resumes
from the last checkpoint instead of starting over) and the output `<data_dir>/drafters/<hash>/`:
`drafter/` (the SGLang-loadable export of the best checkpoint), `train_result.json` (written last: the stage
finished), `mlflow_run.json` (the run a restarted driver keeps logging into) and `resolved_config.yaml`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftline import faults
from draftline.config import ConfigError, DraftlineConfig, shown_config, write_resolved
from draftline.data.prepare import load_split, load_vocab
from draftline.drafter.export import export_from_checkpoint, load_drafter
from draftline.drafter.model import DrafterConfig
from draftline.extract.online import TRAIN, VAL, build_streams, shard_sizes_for, streamed_bytes_per_token
from draftline.extract.run import aux_layer_ids_for, capture_plan, check_dataset_matches_target, target_info
from draftline.extract.shards import HiddenStateShards, ShardError
from draftline.extract.worker import SplitTokens
from draftline.raycluster import ensure_ray
from draftline.records import StageRecord
from draftline.target.load import target_fingerprint
from draftline.target.stages import remove_stage_groups
from draftline.tracking import DRAFTER_ARTIFACT_PATH, mlflow_client, register_export, setup_mlflow
from draftline.train.job import OnlineStream, TrainingJob
from draftline.train.loop import DRAFTER_SUBDIR, SCORE_METRIC, TRAIN_STATE_FILE, train_loop_per_worker
from draftline.train.order import rank_stream_rows
from draftline.utils import (
    StorageFullError,
    StorageFullSink,
    actor_on_driver_node,
    atomic_write_json,
    environment_restored,
    raise_if_storage_full,
    read_json,
    stable_hash,
)

RESULT_FILE = "train_result.json"
MLFLOW_RUN_FILE = "mlflow_run.json"
EXPORT_SUBDIR = "drafter"
# Ray Train's deadline for one start of the worker group (it hands the variable on to its controller).
WORKER_GROUP_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


class WorkerStartTimeoutError(RuntimeError):
    """The training worker group never started: the cluster did not fit it within train.start_timeout_s."""


def _log(msg: str) -> None:
    print(f"[train] {msg}", flush=True)


@dataclass
class TrainResult(StageRecord):
    """The train stage's output, also kept beside the checkpoints as train_result.json."""

    STAGE = "train"
    run_id: str
    model_version: str
    export_dir: Path
    metrics: dict[str, float]
    best_step: int
    training_hash: str
    wall_s: float
    cached: bool = False
    tags: dict[str, str] = field(default_factory=dict)



def git_commit() -> str:
    """HEAD of the repository this code runs from; 'unknown' outside a git checkout (e.g. a Ray job working dir)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": "0.001"} (MLflow params are flat strings)."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)
    return flat


def config_params(cfg: DraftlineConfig) -> dict[str, str]:
    """The config as MLflow params of a training run (credentials in URIs redacted)."""
    return flatten(shown_config(cfg))


@dataclass
class TrainInputs:
    """Everything the workers need, checked on the driver before any worker starts."""

    target_dir: Path
    target_fingerprint: str
    target_hf_config: Any
    dataset_hash: str
    d2t: torch.Tensor
    t2d: torch.Tensor
    aux_layer_ids: list[int]
    train_samples: int
    train_tokens: int
    # What the hidden states are, for the training hash: shard checksums (offline), how they are computed (online).
    hidden_key: Any
    # Hidden-state bytes per token: stored in the shards (offline, measured) or streamed (online, by layout).
    bytes_per_token: float
    train_location: str | None = None  # offline: the shards' split directories
    val_location: str | None = None
    online: dict | None = None  # online: {"plan", "split_tokens"} for draftline.extract.online.build_streams

    @property
    def source(self) -> str:
        return "streamed" if self.online else "stored"


def _open_split(hidden_dir: str, split: str):
    location = f"{str(hidden_dir).rstrip('/')}/{split}"
    try:
        shards = HiddenStateShards(location)
    except ShardError as err:
        raise ConfigError(f"train: {split} hidden states: {err}") from None
    if len(shards) == 0:
        raise ConfigError(f"train: {location} holds no samples; check data.split and rerun `draftline extract`")
    return location, shards


def check_inputs(cfg: DraftlineConfig, hidden_dir: str | os.PathLike, dataset_dir: str | os.PathLike,
                 target_dir: str | os.PathLike) -> TrainInputs:
    from transformers import AutoConfig

    target_dir, dataset_dir = Path(target_dir), Path(dataset_dir)
    fingerprint = target_fingerprint(target_dir)
    hf_config = AutoConfig.from_pretrained(target_dir, trust_remote_code=cfg.target.trust_remote_code)
    train_location, train_shards = _open_split(str(hidden_dir), "train")
    val_location, val_shards = _open_split(str(hidden_dir), "val")
    aux_layer_ids = train_shards.aux_layer_ids
    for shards in (train_shards, val_shards):
        shards.check_compatible(fingerprint, aux_layer_ids, int(hf_config.hidden_size))
    manifest_path = dataset_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ConfigError(f"train: {dataset_dir} has no manifest.json; pass the directory `draftline prepare` wrote")
    dataset_hash = read_json(manifest_path)["dataset_hash"]
    for split, shards in (("train", train_shards), ("val", val_shards)):
        if shards.manifest["dataset_hash"] != dataset_hash:
            raise ConfigError(
                f"train: {split} hidden states in {shards.location} come from dataset {shards.manifest['dataset_hash']}, "
                f"but the dataset dir {dataset_dir} is {dataset_hash}; the draft vocab must come from the same dataset. "
                "Pass the matching dataset dir or re-extract"
            )
    d2t, t2d = _vocab(dataset_dir, hf_config)
    manifest = train_shards.manifest
    return TrainInputs(
        target_dir=target_dir,
        target_fingerprint=fingerprint,
        target_hf_config=hf_config,
        dataset_hash=dataset_hash,
        d2t=d2t,
        t2d=t2d,
        aux_layer_ids=aux_layer_ids,
        train_samples=int(manifest["total_samples"]),
        train_tokens=int(manifest["total_tokens"]),
        hidden_key=[s["sha256"] for split in (train_shards, val_shards) for s in split.manifest["shards"]],
        bytes_per_token=float(manifest["bytes_per_token"]),
        train_location=train_location,
        val_location=val_location,
    )


def _vocab(dataset_dir: Path, hf_config) -> tuple[torch.Tensor, torch.Tensor]:
    d2t, t2d = load_vocab(dataset_dir)
    if t2d.shape[0] != int(hf_config.vocab_size):
        raise ConfigError(
            f"train: t2d in {dataset_dir} covers {t2d.shape[0]} tokens, the target's vocab_size is {hf_config.vocab_size}"
        )
    return d2t, t2d


def check_init_from(cfg: DraftlineConfig, drafter_config: DrafterConfig, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """train.init_from must be a drafter of this run's shape trained with this dataset's draft vocab."""
    where = f"train.init_from={cfg.train.init_from}"
    try:
        start = load_drafter(cfg.train.init_from)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"{where}: {err}; point it at a drafter export directory, or leave it empty") from None
    differing = [f"{name} {getattr(start.config, name)!r} (this run: {getattr(drafter_config, name)!r})"
                 for name in drafter_config.to_dict() if getattr(start.config, name) != getattr(drafter_config, name)]
    if differing:
        raise ConfigError(f"{where} is a drafter of another shape: {'; '.join(differing)}; train with the settings it "
                          "was trained with (train.num_attention_heads, train.intermediate_size, the same target)")
    if not (torch.equal(start.d2t.cpu(), d2t) and torch.equal(start.t2d.cpu(), t2d)):
        raise ConfigError(f"{where} was trained with another draft vocab than this dataset's: prepare the dataset with "
                          "data.draft_vocab_file set to that drafter's vocab (draftline refresh does)")


def online_inputs(cfg: DraftlineConfig, dataset_dir: str | os.PathLike, target_dir: str | os.PathLike) -> TrainInputs:
    """extract.mode=online: no shards; the prepared splits' tokens and the capture plan go to the target actors."""
    from transformers import AutoConfig

    dataset_dir = Path(dataset_dir)
    target = target_info(cfg, Path(target_dir))
    hf_config = AutoConfig.from_pretrained(target.target_dir, trust_remote_code=cfg.target.trust_remote_code)
    dataset_hash = check_dataset_matches_target(dataset_dir, target)["dataset_hash"]
    aux_layer_ids = aux_layer_ids_for(cfg, target)
    split_tokens = {TRAIN: SplitTokens.from_samples(load_split(dataset_dir, "train")),
                    VAL: SplitTokens.from_samples(load_split(dataset_dir, "val"))}
    for split, tokens in split_tokens.items():
        if len(tokens) == 0:
            raise ConfigError(f"train: the {('train', 'val')[split]} split of {dataset_dir} holds no samples; check data.split")
    d2t, t2d = _vocab(dataset_dir, hf_config)
    extract_cfg = cfg.extract
    return TrainInputs(
        target_dir=target.target_dir,
        target_fingerprint=target.fingerprint,
        target_hf_config=hf_config,
        dataset_hash=dataset_hash,
        d2t=d2t,
        t2d=t2d,
        aux_layer_ids=aux_layer_ids,
        train_samples=len(split_tokens[TRAIN]),
        train_tokens=split_tokens[TRAIN].total_tokens,
        # What offline's shard checksums pin down, by recipe (the same target and dataset are hashed above).
        hidden_key={"mode": "online", "aux_layer_ids": aux_layer_ids, "dtype": extract_cfg.dtype,
                    "target_dtype": cfg.target.dtype, "samples_per_shard": extract_cfg.samples_per_shard},
        bytes_per_token=float(streamed_bytes_per_token(len(aux_layer_ids), target.hidden_size, extract_cfg.dtype)),
        online={"plan": capture_plan(cfg, target, aux_layer_ids), "split_tokens": split_tokens},
    )


def training_hash(cfg: DraftlineConfig, inputs: TrainInputs) -> str:
    """Changes whenever the trained weights could: train config, seed, target, dataset, hidden states."""
    train_section = cfg.train.model_dump(mode="json")
    # attention and packing change how the same loss is computed (float rounding), not what is trained.
    for not_affecting in ("max_failures", "log_every", "storage_uri", "start_timeout_s", "collective_timeout_s",
                          "attention", "packing", "packed_row_tokens"):
        train_section.pop(not_affecting)
    if train_section["init_from"] is None:  # fresh weights: the hash training had before init_from existed
        train_section.pop("init_from")
    return stable_hash(train_section, cfg.seed, inputs.target_fingerprint, inputs.dataset_hash, inputs.hidden_key)[:16]


def _start_or_resume_mlflow_run(cfg: DraftlineConfig, out_dir: Path, train_hash: str, inputs: TrainInputs) -> str:
    """The driver owns the MLflow run (so its id is known); a restarted driver keeps logging into the same run."""
    from mlflow import MlflowClient
    from mlflow.entities import Param, RunStatus
    from mlflow.exceptions import MlflowException

    experiment_id = setup_mlflow(cfg)
    client = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
    record_path = out_dir / MLFLOW_RUN_FILE
    if record_path.is_file():
        run_id = read_json(record_path)["run_id"]
        try:
            run = client.get_run(run_id)
        except MlflowException:
            run = None
        if run is not None and run.info.status != RunStatus.to_string(RunStatus.FINISHED):
            client.update_run(run_id, status="RUNNING")
            _log(f"continuing MLflow run {run_id}")
            return run_id
    run = client.create_run(
        experiment_id,
        run_name=f"train-{cfg.target.name}-{train_hash}",
        tags={"draftline.stage": "train", "training_hash": train_hash, "target_fingerprint": inputs.target_fingerprint,
              "dataset_hash": inputs.dataset_hash},
    )
    run_id = run.info.run_id
    params = {
        **config_params(cfg),
        "inputs.training_hash": train_hash,
        "inputs.target_dir": str(inputs.target_dir),
        "inputs.target_fingerprint": inputs.target_fingerprint,
        "inputs.dataset_hash": inputs.dataset_hash,
        "inputs.train_hidden": inputs.train_location or "online",
        "inputs.val_hidden": inputs.val_location or "online",
        "inputs.aux_layer_ids": str(inputs.aux_layer_ids),
        "inputs.train_samples": str(inputs.train_samples),
        "inputs.train_tokens": str(inputs.train_tokens),
        f"inputs.{inputs.source}_bytes_per_token": f"{inputs.bytes_per_token:.1f}",
    }
    items = [Param(key, value[:6000]) for key, value in sorted(params.items())]
    for start in range(0, len(items), 100):  # MLflow caps a batch at 100 params
        client.log_batch(run_id, params=items[start : start + 100])
    atomic_write_json(record_path, {"run_id": run_id, "tracking_uri": cfg.mlflow_tracking_uri_shown})
    return run_id


def _cached_result(cfg: DraftlineConfig, out_dir: Path) -> TrainResult | None:
    """A finished training with this hash whose model version is in the configured registry (another tracking
    store, e.g. a fresh MLflow server, gets the version registered again from the kept checkpoints)."""
    from mlflow.exceptions import MlflowException

    if not (out_dir / RESULT_FILE).is_file():
        return None
    result = TrainResult.from_dict(read_json(out_dir / RESULT_FILE), out_dir / RESULT_FILE)
    try:
        version = mlflow_client(cfg).get_model_version(cfg.registered_model_name, result.model_version)
    except MlflowException:
        version = None
    if version is None or version.tags.get("training_hash") != result.training_hash:
        _log(f"{out_dir} finished before, but {cfg.registered_model_name} version {result.model_version} is not in "
             f"{cfg.mlflow_tracking_uri_shown}; exporting and registering again")
        (out_dir / RESULT_FILE).unlink()
        (out_dir / MLFLOW_RUN_FILE).unlink(missing_ok=True)
        return None
    result.cached = True
    _log(f"cached: {out_dir} (MLflow run {result.run_id}, model version {result.model_version})")
    return result


def _best_checkpoint(result, score_metric: str):
    """(checkpoint, metrics) with the highest validation score among those Ray Train kept."""
    candidates = [(ckpt, metrics) for ckpt, metrics in (result.best_checkpoints or []) if score_metric in metrics]
    if not candidates:
        raise RuntimeError(
            f"training finished without a checkpoint carrying {score_metric}; see the worker logs above "
            f"({getattr(result, 'path', '?')})"
        )
    return max(candidates, key=lambda item: item[1][score_metric])


def checkpoint_storage_path(cfg: DraftlineConfig) -> str:
    return cfg.train.storage_uri or str(cfg.data_path("ray", "train"))


def _caused_by(err: BaseException, type_name: str) -> bool:
    """Whether `err`, the exceptions it was raised from, or the failure a Ray Train error wraps is a `type_name`."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [err]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if type(current).__name__ == type_name:
            return True
        pending += [current.__cause__, current.__context__, getattr(current, "controller_failure", None)]
    return False


def worker_start_timeout_message(cfg: DraftlineConfig, resources_per_worker: dict) -> str:
    import ray

    train_cfg = cfg.train
    timeout_s = float(os.environ.get(WORKER_GROUP_START_TIMEOUT_ENV, train_cfg.start_timeout_s))
    free = {k: v for k, v in ray.available_resources().items() if k in resources_per_worker}
    total = {k: v for k, v in ray.cluster_resources().items() if k in resources_per_worker}
    return (
        f"training workers did not start: Ray Train waited {timeout_s:g} s (train.start_timeout_s), "
        f"{1 + train_cfg.max_failures} time(s), for {train_cfg.num_workers} worker(s) of {resources_per_worker} each; "
        f"the cluster has {free} free of {total}. Free those resources (another job or a leftover placement group may "
        "hold them: `ray status`), lower train.num_workers or train.cpus_per_worker, or raise train.start_timeout_s"
    )


def _run_workers(job: TrainingJob, run_name: str, online: dict | None = None):
    """trainer.fit(); a full disk in any worker raises StorageFullError with that worker's one line. `online`
    (TrainInputs.online): each worker reads a stream of the target's states instead of shards."""
    cfg = job.cfg
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    train_cfg = cfg.train
    resources_per_worker = {"CPU": train_cfg.cpus_per_worker}
    if train_cfg.use_gpu:
        resources_per_worker["GPU"] = 1
    storage_full_sink = actor_on_driver_node(StorageFullSink)
    data_kwargs: dict = {}
    stream = None
    if online is not None:
        shard_sizes = shard_sizes_for(len(online["split_tokens"][TRAIN]), cfg.extract.samples_per_shard)
        num_val_samples = len(online["split_tokens"][VAL])
        rows_per_rank = [rank_stream_rows(rank, train_cfg.num_workers, train_cfg, shard_sizes, num_val_samples, cfg.seed)
                         for rank in range(train_cfg.num_workers)]  # fmt: skip
        streams = build_streams(cfg, online["plan"], online["split_tokens"], rows_per_rank)
        data_kwargs = {"datasets": streams.datasets, "dataset_config": streams.data_config}
        stream = OnlineStream(streams.cursor, shard_sizes, num_val_samples)
    job = job.with_run(f"{checkpoint_storage_path(cfg).rstrip('/')}/{run_name}", storage_full_sink, stream)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=job.to_loop_config(),
        **data_kwargs,
        torch_config=TorchConfig(backend=train_cfg.backend, timeout_s=int(train_cfg.collective_timeout_s)),
        scaling_config=ScalingConfig(
            num_workers=train_cfg.num_workers, use_gpu=train_cfg.use_gpu, resources_per_worker=resources_per_worker
        ),
        run_config=RunConfig(
            name=run_name,
            storage_path=checkpoint_storage_path(cfg),
            # A start that times out is a controller failure, which Ray Train retries forever unless limited.
            failure_config=FailureConfig(max_failures=train_cfg.max_failures,
                                         controller_failure_limit=train_cfg.max_failures),
            checkpoint_config=CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute=SCORE_METRIC, checkpoint_score_order="max"
            ),
        ),
    )
    try:
        with environment_restored(WORKER_GROUP_START_TIMEOUT_ENV):  # Ray Train hands it on to its controller
            os.environ.setdefault(WORKER_GROUP_START_TIMEOUT_ENV, str(train_cfg.start_timeout_s))
            return trainer.fit()
    except Exception as err:
        if _caused_by(err, "WorkerGroupStartupTimeoutError"):
            raise WorkerStartTimeoutError(worker_start_timeout_message(cfg, resources_per_worker)) from err
        raise
    finally:
        if online is not None:  # the target actors' stage groups (extract.pipeline): Ray keeps them until the job ends
            remove_stage_groups(online["plan"]["stage_groups"])
        storage_full = ray.get(storage_full_sink.messages.remote())
        ray.kill(storage_full_sink)
        if storage_full:  # the cause, whether fit() then returned (the retried group stops at once) or raised
            raise StorageFullError(storage_full[0]) from None


def hidden_states_line(cfg: DraftlineConfig, inputs: TrainInputs) -> str:
    """The console line that says where the hidden states come from and their bytes per token."""
    if inputs.online:
        online = cfg.extract.online
        return (
            f"hidden states online: {online.actors_per_train_worker} target actor(s) per worker stream "
            f"{inputs.bytes_per_token:.0f} bytes per token through Ray's object store (at most "
            f"{online.object_store_memory_mb:g} MB waiting per worker), none written to disk"
        )
    return f"hidden states offline: {inputs.bytes_per_token:.0f} bytes per token stored in {inputs.train_location}"


def train(
    cfg: DraftlineConfig,
    hidden_dir: str | os.PathLike | None,
    dataset_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
) -> TrainResult:
    """Train, export the best checkpoint, log everything to MLflow and register a model version."""
    from mlflow import MlflowClient

    if cfg.extract.mode == "online":
        inputs = online_inputs(cfg, dataset_dir, target_dir)
    else:
        if hidden_dir is None:
            raise ConfigError("train: extract.mode is offline but no hidden states were given; run `draftline extract`")
        inputs = check_inputs(cfg, hidden_dir, dataset_dir, target_dir)
    train_hash = training_hash(cfg, inputs)
    out_dir = cfg.data_path("drafters", train_hash)
    cached = _cached_result(cfg, out_dir)
    if cached is not None:
        return cached
    write_resolved(cfg, out_dir)
    drafter_config = DrafterConfig.from_target(
        inputs.target_hf_config,
        draft_vocab_size=int(inputs.d2t.shape[0]),
        aux_layer_ids=inputs.aux_layer_ids,
        num_attention_heads=cfg.train.num_attention_heads,
        intermediate_size=cfg.train.intermediate_size,
    )
    if cfg.train.init_from:
        check_init_from(cfg, drafter_config, inputs.d2t, inputs.t2d)
    run_id = _start_or_resume_mlflow_run(cfg, out_dir, train_hash, inputs)
    job = TrainingJob(
        cfg=cfg, target_dir=str(inputs.target_dir), d2t=inputs.d2t, t2d=inputs.t2d, drafter_config=drafter_config,
        tracking_uri=cfg.mlflow_tracking_uri, run_id=run_id, train_location=inputs.train_location,
        val_location=inputs.val_location, fault=faults.planned("train.step"),
    )
    client = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
    _log(
        f"{cfg.train.num_workers} worker(s) x {cfg.train.cpus_per_worker} CPU, gpu={cfg.train.use_gpu}, "
        f"ZeRO-{cfg.train.zero_stage}, {cfg.train.dtype}; {inputs.train_samples} train samples; "
        f"{cfg.train.max_steps} steps; MLflow run {run_id}"
    )
    _log(hidden_states_line(cfg, inputs))
    ensure_ray(cfg)
    started = time.perf_counter()
    try:
        ray_result = _run_workers(job, run_name=f"train-{train_hash}", online=inputs.online)
    except (StorageFullError, WorkerStartTimeoutError):  # no retry or rerun fixes these: their line says what does
        with contextlib.suppress(Exception):  # the tracking store may be on the same full disk: the line matters more
            client.set_terminated(run_id, status="FAILED")
        raise
    except Exception as err:
        client.set_terminated(run_id, status="FAILED")
        raise RuntimeError(
            f"training failed more than train.max_failures={cfg.train.max_failures} times ({err}). Checkpoints are "
            f"kept under {checkpoint_storage_path(cfg)}/train-{train_hash}: fix the cause "
            "and rerun the same command to resume from the last one"
        ) from err
    wall_s = time.perf_counter() - started

    best_checkpoint, best_metrics = _best_checkpoint(ray_result, SCORE_METRIC)
    with best_checkpoint.as_directory() as checkpoint_dir:
        state = read_json(Path(checkpoint_dir) / TRAIN_STATE_FILE)
        val_metrics = {k: float(v) for k, v in best_metrics.items() if k.startswith("val_")}
        git = git_commit()
        meta = {
            "target_name": cfg.target.name,
            "target_fingerprint": inputs.target_fingerprint,
            "dataset_hash": inputs.dataset_hash,
            "training_hash": train_hash,
            "mlflow_run_id": run_id,
            "git_commit": git,
            "step": int(best_metrics["step"]),
            "val_metrics": val_metrics,
        }
        export_dir = export_from_checkpoint(Path(checkpoint_dir) / DRAFTER_SUBDIR, out_dir / EXPORT_SUBDIR, meta=meta)
    best_step = int(best_metrics["step"])
    if state.get("best_step") is not None and state["best_step"] != best_step:
        raise RuntimeError(
            f"the kept checkpoint with the best {SCORE_METRIC} is from step {best_step}, but the workers tracked "
            f"step {state['best_step']} as best; checkpoints in {ray_result.path} are inconsistent"
        )

    steps = cfg.train.ttt_steps
    tags = {
        "target_fingerprint": inputs.target_fingerprint,
        "dataset_hash": inputs.dataset_hash,
        "git_commit": git,
        "training_hash": train_hash,
        "aux_layer_ids": str(inputs.aux_layer_ids),
        "best_step": best_step,
        SCORE_METRIC: f"{val_metrics[SCORE_METRIC]:.4f}",
        **{f"val_acc_{k}": f"{val_metrics[f'val_acc_{k}']:.4f}" for k in range(steps)},
    }
    # Registered only after the whole export is uploaded: a full disk here leaves no version; a rerun uploads again.
    with raise_if_storage_full(f"{client.get_run(run_id).info.artifact_uri}/{DRAFTER_ARTIFACT_PATH}",
                               "data_dir (or tracking.artifact_location)"):
        version = register_export(cfg, run_id, export_dir, tags=tags)
    summary = {"final_best_val_est_accept_len": val_metrics[SCORE_METRIC], "final_best_step": best_step,
               "train_wall_s": wall_s}
    final_step = int(ray_result.metrics.get("step", best_step)) if ray_result.metrics else best_step
    for key, value in summary.items():
        client.log_metric(run_id, key, float(value), step=final_step)
    client.set_tag(run_id, "model_version", version)
    client.set_terminated(run_id, status="FINISHED")

    result = TrainResult(
        run_id=run_id,
        model_version=version,
        export_dir=export_dir,
        metrics=val_metrics,
        best_step=best_step,
        training_hash=train_hash,
        wall_s=round(wall_s, 2),
        tags={k: str(v) for k, v in tags.items()},
    )
    atomic_write_json(out_dir / RESULT_FILE, result.to_dict())
    _log(
        f"best step {best_step}: val acc_0 {val_metrics['val_acc_0']:.3f}, est_accept_len "
        f"{val_metrics[SCORE_METRIC]:.3f}; exported to {export_dir}; registered "
        f"{cfg.registered_model_name} version {version}; {wall_s:.0f} s"
    )
    return result

