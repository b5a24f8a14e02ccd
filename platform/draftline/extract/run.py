"""Stage 3 driver: plan the shards, run the Ray Train worker group, watch progress, write the manifests.

Output `<hidden_root>/<hash>/<split>/` (split = train, val) with shards + manifest.json, and
`<hidden_root>/<hash>/resolved_config.yaml`. `<hash>` covers everything the numbers depend on, so a changed
input never reuses stale states; within one hash a rerun skips complete shards and redoes the rest.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from draftline import faults
from draftline.config import ConfigError, DraftlineConfig, config_to_yaml
from draftline.data.prepare import load_split, prepare, tokenizer_fingerprint
from draftline.extract.job import ExtractionJob, SplitAssignment
from draftline.extract.shards import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    ShardError,
    ShardRecord,
    build_manifest,
    estimated_split_bytes,
    num_shards,
    read_shard_record,
    shard_file_name,
    shard_sample_range,
    stored_bytes_per_token,
    write_manifest,
)
from draftline.extract.storage import Storage
from draftline.extract.worker import SplitTokens, extract_loop_per_worker
from draftline.raycluster import ensure_ray
from draftline.records import StageRecord, written_if_set
from draftline.target.aux_layers import family_of
from draftline.target.load import read_target_config, resolve_aux_layer_ids, resolve_target_dir, target_fingerprint
from draftline.target.stages import remove_stage_groups
from draftline.utils import StorageFullError, StorageFullSink, actor_on_driver_node, is_uri, read_json, stable_hash

DEFAULT_SPLITS = ("train", "val")


def _log(msg: str) -> None:
    print(f"[extract] {msg}", flush=True)


@dataclass
class TargetInfo:
    target_dir: Path
    name: str
    fingerprint: str
    num_layers: int
    hidden_size: int
    pad_id: int


@dataclass
class SplitResult:
    split: str
    location: str
    manifest: dict
    cached: bool
    new_samples: int = 0
    new_tokens: int = 0
    new_bytes: int = 0
    wall_s: float = 0.0
    extract_window_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.extract_window_s if self.extract_window_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.new_samples / self.extract_window_s if self.extract_window_s > 0 else 0.0


def target_info(cfg: DraftlineConfig, target_dir: Path | None = None) -> TargetInfo:
    target_dir = Path(target_dir) if target_dir is not None else resolve_target_dir(cfg)
    hf_config = read_target_config(target_dir)
    return TargetInfo(
        target_dir=target_dir,
        name=cfg.target.name,
        fingerprint=target_fingerprint(target_dir),
        num_layers=int(hf_config["num_hidden_layers"]),
        hidden_size=int(hf_config["hidden_size"]),
        pad_id=int(hf_config.get("pad_token_id") or 0),
    )


def aux_layer_ids_for(cfg: DraftlineConfig, target: TargetInfo) -> list[int]:
    return resolve_aux_layer_ids(cfg, target.num_layers, family_of(read_target_config(target.target_dir)))


def hidden_root(cfg: DraftlineConfig) -> Storage:
    return Storage(cfg.extract.storage_uri or cfg.data_path("hidden"))


def extraction_hash(cfg: DraftlineConfig, dataset_hash: str, target: TargetInfo, aux_layer_ids: list[int]) -> str:
    return stable_hash(
        FORMAT_VERSION,
        dataset_hash,
        target.fingerprint,
        cfg.target.dtype,
        aux_layer_ids,
        cfg.extract.dtype,
        cfg.extract.samples_per_shard,
    )[:16]


def check_dataset_matches_target(dataset_dir: Path, target: TargetInfo) -> dict:
    manifest_path = dataset_dir / "manifest.json"
    if not manifest_path.exists():
        raise FileNotFoundError(f"{dataset_dir} has no manifest.json: run `draftline prepare` first (or pass its output dir)")
    dataset_manifest = read_json(manifest_path)
    if dataset_manifest.get("tokenizer_fingerprint") != tokenizer_fingerprint(target.target_dir):
        raise ConfigError(
            f"dataset {dataset_dir} was tokenized with another tokenizer than the target at {target.target_dir}; "
            "run `draftline prepare` with this config and extract from its output"
        )
    return dataset_manifest


def _records_if_all_present(storage: Storage, total_shards: int) -> list[ShardRecord] | None:
    """Cheap completeness check (records + sizes) after the workers, which checksummed every shard they kept or wrote."""
    records = []
    for shard_index in range(total_shards):
        record = read_shard_record(storage, shard_index)
        if record is None or storage.size_bytes(record.file) != record.bytes:
            return None
        records.append(record)
    return records


def _manifest_matches_files(storage: Storage) -> dict | None:
    if not storage.exists(MANIFEST_NAME):
        return None
    try:
        manifest = json.loads(storage.read_bytes(MANIFEST_NAME))
    except ValueError:  # unreadable: treat as absent, the split is checked shard by shard and the manifest rewritten
        return None
    # Hashed, not only sized: a shard overwritten in place keeps its size. A mismatch sends the split back to the
    # workers, which redo exactly the shards whose checksum fails (complete_shard_record).
    for shard in manifest["shards"]:
        if storage.size_bytes(shard["file"]) != shard["bytes"] or storage.sha256(shard["file"]) != shard["sha256"]:
            return None
    return manifest


@dataclass
class SplitJob:
    """One split still to extract: where it goes and its tokens."""

    split: str
    storage: Storage
    split_tokens: SplitTokens
    samples_per_shard: int

    @property
    def total_shards(self) -> int:
        return num_shards(len(self.split_tokens), self.samples_per_shard)


class _ProgressWatcher:
    """Polls the shard records the workers write, so progress survives worker restarts and works on any storage."""

    def __init__(self, jobs: list[SplitJob], run_started_unix: float):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.jobs = jobs
        self.run_started_unix = run_started_unix
        self.seen: dict[str, dict[str, ShardRecord]] = {job.split: {} for job in jobs}
        self.seen_mtime_ns: dict[str, dict[str, int]] = {job.split: {} for job in jobs}
        self.progress = Progress(
            TextColumn("[extract] {task.description:5s}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("samples  {task.fields[samples_per_s]:.1f} samples/s  {task.fields[tokens_per_s]:.0f} tokens/s"),
            TimeElapsedColumn(),
        )
        self.tasks = {
            job.split: self.progress.add_task(job.split, total=len(job.split_tokens), samples_per_s=0.0, tokens_per_s=0.0)
            for job in jobs
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def new_records(self, split: str) -> list[ShardRecord]:
        """Shards written by this run (not ones found complete from an earlier run)."""
        return [r for r in self.seen[split].values() if r.started_unix >= self.run_started_unix]

    def poll(self) -> None:
        for job in self.jobs:
            seen, seen_mtime_ns = self.seen[job.split], self.seen_mtime_ns[job.split]
            for name, mtime_ns in job.storage.list_files().items():
                # Read a record only when it is new or rewritten: listing is one call, reads are one per file.
                if name.startswith("shard-") and name.endswith(".json") and seen_mtime_ns.get(name) != mtime_ns:
                    record = read_shard_record(job.storage, int(name[len("shard-") : -len(".json")]))
                    if record is not None:
                        seen[name], seen_mtime_ns[name] = record, mtime_ns
            new = self.new_records(job.split)
            completed = sum(r.samples for r in seen.values())
            # Rates over the time the workers have been extracting this split, not the worker group's start-up.
            now = time.time()
            end = max((r.finished_unix for r in new), default=now) if completed == len(job.split_tokens) else now
            elapsed_s = max(end - min((r.started_unix for r in new), default=now), 1e-6)
            self.progress.update(
                self.tasks[job.split],
                completed=completed,
                samples_per_s=sum(r.samples for r in new) / elapsed_s,
                tokens_per_s=sum(r.tokens for r in new) / elapsed_s,
            )

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.poll()

    def __enter__(self) -> "_ProgressWatcher":
        self.progress.start()
        self.poll()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()
        self.progress.stop()


def _run_worker_group(cfg: DraftlineConfig, plan: dict, jobs: list[SplitJob], run_name: str) -> None:
    """One Ray Train worker group for all splits (start-up dominates small runs; pay it once)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # With extract.pipeline a worker only drives its pipeline: the stage actors take the GPUs (target.stages).
    worker_gpu = cfg.extract.use_gpu and cfg.extract.pipeline is None
    resources_per_worker = {"CPU": cfg.extract.cpus_per_worker}
    if worker_gpu:
        resources_per_worker["GPU"] = 1
    storage_full_sink = actor_on_driver_node(StorageFullSink)
    extraction_job = ExtractionJob(
        cfg=cfg,
        plan=plan,
        splits=[SplitAssignment(job.split, job.storage.location, ray.put(job.split_tokens)) for job in jobs],
        fault=faults.planned("extract.shards"),
        storage_full_sink=storage_full_sink,
    )
    trainer = TorchTrainer(
        extract_loop_per_worker,
        train_loop_config=extraction_job.to_loop_config(),
        scaling_config=ScalingConfig(
            num_workers=cfg.extract.num_workers, use_gpu=worker_gpu, resources_per_worker=resources_per_worker
        ),
        run_config=RunConfig(
            name=run_name,
            storage_path=str(cfg.data_path("ray", "train")),
            failure_config=FailureConfig(max_failures=cfg.extract.max_failures),
        ),
    )
    failure: Exception | None = None
    try:
        trainer.fit()
    except Exception as err:
        failure = err
    finally:
        remove_stage_groups(plan["stage_groups"])  # those of killed workers, which no `finally` of theirs removed
    storage_full = ray.get(storage_full_sink.messages.remote())
    ray.kill(storage_full_sink)
    if storage_full:  # the cause, even when another worker then failed too
        raise StorageFullError(storage_full[0]) from None
    if failure is not None:
        locations = ", ".join(job.storage.location for job in jobs)
        raise RuntimeError(
            f"extraction workers failed more than extract.max_failures={cfg.extract.max_failures} times ({failure}). "
            f"Complete shards in {locations} are kept: fix the cause and rerun to resume"
        ) from failure


def _finish_split(
    cfg: DraftlineConfig, job: SplitJob, new_records: list[ShardRecord], wall_s: float, manifest_fields: dict
) -> SplitResult:
    """Check every shard of the split is there with the right sample range, then write its manifest."""
    storage, split_tokens = job.storage, job.split_tokens
    records = _records_if_all_present(storage, job.total_shards)
    if records is None:
        missing = [shard_file_name(i) for i in range(job.total_shards) if read_shard_record(storage, i) is None]
        raise ShardError(
            f"{job.split}: the workers finished but shards {missing[:5]} in {storage.location} are missing or "
            "incomplete; rerun `draftline extract` to redo them"
        )
    for shard_index, record in enumerate(records):
        expected = shard_sample_range(shard_index, len(split_tokens), job.samples_per_shard)
        if (record.first_sample, record.samples) != (expected.start, len(expected)):
            raise ShardError(
                f"{storage.uri(record.file)} holds samples {record.first_sample}..+{record.samples}, expected "
                f"{expected.start}..+{len(expected)}; delete it and rerun `draftline extract`"
            )
    storage.remove_temp_files()
    window_s = (
        max(r.finished_unix for r in new_records) - min(r.started_unix for r in new_records) if new_records else 0.0
    )
    manifest = build_manifest(
        records, split=job.split, samples_per_shard=job.samples_per_shard, total_samples=len(split_tokens),
        **manifest_fields,
    )
    manifest["last_run"] = {
        "num_workers": cfg.extract.num_workers,
        "shards_written": len(new_records),
        "wall_s": round(wall_s, 3),
        "extract_window_s": round(window_s, 3),
    }
    write_manifest(storage, manifest)
    return SplitResult(
        split=job.split,
        location=storage.location,
        manifest=manifest,
        cached=False,
        new_samples=sum(r.samples for r in new_records),
        new_tokens=sum(r.tokens for r in new_records),
        new_bytes=sum(r.bytes for r in new_records),
        wall_s=wall_s,
        extract_window_s=window_s,
    )


def storage_estimate(cfg: DraftlineConfig, jobs: list[SplitJob], target: TargetInfo, aux_layer_ids: list[int]) -> dict:
    """Bytes per token and shard bytes per split that extraction is about to write (see shards.estimated_split_bytes)."""
    num_aux, hidden_size, dtype = len(aux_layer_ids), target.hidden_size, cfg.extract.dtype
    splits = {
        job.split: {
            "samples": len(job.split_tokens),
            "tokens": job.split_tokens.total_tokens,
            "estimated_bytes": estimated_split_bytes(
                len(job.split_tokens), job.split_tokens.total_tokens, job.total_shards, num_aux, hidden_size, dtype
            ),
        }
        for job in jobs
    }
    return {
        "bytes_per_token": stored_bytes_per_token(num_aux, hidden_size, dtype),
        "layout": f"{num_aux} aux + 1 final hidden states x {hidden_size} x {dtype}, token id and loss mask",
        "splits": splits,
        "estimated_bytes": sum(s["estimated_bytes"] for s in splits.values()),
    }


def log_storage_estimate(
    cfg: DraftlineConfig, jobs: list[SplitJob], target: TargetInfo, aux_layer_ids: list[int], root: Storage
) -> dict:
    """Print the estimate before any forward pass, keep it as <root>/storage_estimate.json, warn when the local disk
    holds less (a full disk mid-extraction costs the run; what was written stays and a rerun resumes)."""
    import shutil

    estimate = storage_estimate(cfg, jobs, target, aux_layer_ids)
    for split, numbers in estimate["splits"].items():
        _log(f"{split}: estimated {numbers['estimated_bytes'] / 1e9:.3f} GB on disk")
    _log(
        f"stored per token: {estimate['bytes_per_token']} bytes ({estimate['layout']}); estimated "
        f"{estimate['estimated_bytes'] / 1e9:.3f} GB for this extraction"
    )
    root.write_bytes("storage_estimate.json", (json.dumps(estimate, indent=2) + "\n").encode())
    if not is_uri(root.location):
        free_bytes = shutil.disk_usage(root.location).free
        if free_bytes < estimate["estimated_bytes"]:
            _log(
                f"WARNING: {root.location} has {free_bytes / 1e9:.3f} GB free, less than the estimated "
                f"{estimate['estimated_bytes'] / 1e9:.3f} GB: set extract.storage_uri to larger storage or "
                "extract.dtype=bfloat16 (half the bytes)"
            )
    return estimate


def capture_plan(cfg: DraftlineConfig, target: TargetInfo, aux_layer_ids: list[int]) -> dict:
    """What a process running the target needs to capture what the drafter is fed (offline workers, online actors)."""
    return {
        "target_dir": str(target.target_dir),
        "target_fingerprint": target.fingerprint,
        "aux_layer_ids": aux_layer_ids,
        "batch_size": cfg.extract.batch_size,
        "pad_id": target.pad_id,
        "dtype": cfg.extract.dtype,
        # extract.pipeline: the prefix of this run's stage placement groups (target.stages.remove_stage_groups)
        "stage_groups": f"draftline-stages-{uuid.uuid4().hex[:12]}",
    }


def extract_splits(
    cfg: DraftlineConfig,
    dataset_dir: Path,
    dataset_hash: str,
    splits: tuple[str, ...],
    target: TargetInfo,
    aux_layer_ids: list[int],
    root: Storage,
) -> dict[str, SplitResult]:
    results: dict[str, SplitResult] = {}
    jobs: list[SplitJob] = []
    for split in splits:
        storage = root.child(split)
        cached = _manifest_matches_files(storage)
        if cached is not None:
            _log(f"{split}: cached, {cached['total_samples']} samples in {storage.location}")
            results[split] = SplitResult(split=split, location=storage.location, manifest=cached, cached=True)
            continue
        split_tokens = SplitTokens.from_samples(load_split(dataset_dir, split))
        # An old manifest may list a shard the user deleted to have it redone: it is rewritten once all shards exist.
        storage.delete(MANIFEST_NAME)
        jobs.append(SplitJob(split, storage, split_tokens, cfg.extract.samples_per_shard))
    if not jobs:
        return results

    plan = {
        **capture_plan(cfg, target, aux_layer_ids),
        "samples_per_shard": cfg.extract.samples_per_shard,
        "shard_metadata": {
            "format": "draftline-hidden-states",
            "format_version": str(FORMAT_VERSION),
            "target_fingerprint": target.fingerprint,
            "aux_layer_ids": json.dumps(aux_layer_ids),
        },
    }
    for job in jobs:
        _log(
            f"{job.split}: {len(job.split_tokens)} samples, {job.split_tokens.total_tokens} tokens -> "
            f"{job.total_shards} shards into {job.storage.location}"
        )
    log_storage_estimate(cfg, jobs, target, aux_layer_ids, root)
    run_started_unix = time.time()
    started = time.perf_counter()
    with _ProgressWatcher(jobs, run_started_unix) as watcher:
        if any(job.total_shards for job in jobs):
            _log(f"{cfg.extract.num_workers} worker(s), {cfg.extract.cpus_per_worker} CPU each, gpu={cfg.extract.use_gpu}")
            _run_worker_group(cfg, plan, jobs, run_name=f"extract-{root.location.rsplit('/', 1)[-1]}")
    wall_s = time.perf_counter() - started
    manifest_fields = {
        "target_fingerprint": target.fingerprint,
        "target_name": target.name,
        "target_dtype": cfg.target.dtype,
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "aux_layer_ids": aux_layer_ids,
        "dtype": cfg.extract.dtype,
        "dataset_hash": dataset_hash,
    }
    for job in jobs:
        results[job.split] = _finish_split(cfg, job, watcher.new_records(job.split), wall_s, manifest_fields)
    return results


def summary_text(results: list[SplitResult]) -> str:
    lines = []
    for r in results:
        m = r.manifest
        state = "cached" if r.cached else f"{m['last_run']['shards_written']} shards written now"
        lines.append(
            f"[extract] {r.split}: {m['total_samples']} samples, {m['total_tokens']} tokens, "
            f"{m['total_bytes'] / 1e9:.3f} GB, {m['bytes_per_token']:.0f} bytes/token ({state}) -> {r.location}"
        )
        if not r.cached and r.new_tokens:
            lines.append(
                f"[extract] {r.split}: this run {r.new_tokens} tokens, {r.new_bytes / 1e9:.3f} GB in {r.wall_s:.1f} s "
                f"wall; {r.tokens_per_s:.0f} tokens/s, {r.samples_per_s:.1f} samples/s while extracting "
                f"({r.extract_window_s:.1f} s)"
            )
    return "\n".join(lines)


@dataclass
class ExtractResult:
    location: Path | str  # <hidden_root>/<hash>: a Path for local storage, the URI string otherwise
    splits: dict[str, SplitResult]


@dataclass(frozen=True)
class ExtractedSplit:
    """What the extract stage records of a split's manifest (None where a manifest lacks the key)."""

    total_samples: Optional[int]
    total_tokens: Optional[int]
    bytes_per_token: Optional[float]
    target_fingerprint: Optional[str]


@dataclass(frozen=True)
class ExtractRecord(StageRecord):
    """The extract stage's output. Offline: where the shards are and a summary of each split. Online
    (extract.mode=online): no shards (hidden_dir None); what the stream will carry."""

    STAGE = "extract"
    hidden_dir: Optional[str]
    splits: Optional[dict[str, ExtractedSplit]] = written_if_set()
    mode: Optional[str] = written_if_set()  # "online", or not written (offline)
    streamed_bytes_per_token: Optional[int] = written_if_set()
    aux_layer_ids: Optional[list[int]] = written_if_set()

    @classmethod
    def offline(cls, result: "ExtractResult") -> "ExtractRecord":
        return cls(hidden_dir=str(result.location), splits={
            name: ExtractedSplit(**{k: r.manifest.get(k) for k in
                                    ("total_samples", "total_tokens", "bytes_per_token", "target_fingerprint")})
            for name, r in result.splits.items()
        })

    @classmethod
    def online(cls, streamed_bytes_per_token: int, aux_layer_ids: list[int]) -> "ExtractRecord":
        return cls(hidden_dir=None, mode="online", streamed_bytes_per_token=streamed_bytes_per_token,
                   aux_layer_ids=aux_layer_ids)


def extract_with_stats(
    cfg: DraftlineConfig, dataset_dir: str | os.PathLike | None = None, split: str | None = None
) -> ExtractResult:
    splits = DEFAULT_SPLITS if split in (None, "all") else (split,)
    target = target_info(cfg)
    dataset_dir = Path(dataset_dir) if dataset_dir is not None else prepare(cfg, target.target_dir)
    dataset_manifest = check_dataset_matches_target(dataset_dir, target)
    aux_layer_ids = aux_layer_ids_for(cfg, target)
    dataset_hash = dataset_manifest.get("dataset_hash", dataset_dir.name)
    root = hidden_root(cfg).child(extraction_hash(cfg, dataset_hash, target, aux_layer_ids))
    root.write_bytes("resolved_config.yaml", config_to_yaml(cfg).encode())
    ensure_ray(cfg)
    results = extract_splits(cfg, dataset_dir, dataset_hash, splits, target, aux_layer_ids, root)
    location: Path | str = root.location if is_uri(root.location) else Path(root.location)
    return ExtractResult(location=location, splits=results)


def extract(cfg: DraftlineConfig, dataset_dir: str | os.PathLike | None = None, split: str | None = None) -> Path | str:
    """Extract hidden states for `split` ("train", "val"; None or "all" = both). Returns <hidden_root>/<hash>."""
    return extract_with_stats(cfg, dataset_dir, split).location
