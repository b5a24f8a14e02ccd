"""Hidden-state shards: the file contract between extract (writer) and train (reader). See docs/extract.md.

A split directory holds `shard-00000.safetensors`, ... and `manifest.json`. Shard i holds the fixed sample range
[i * samples_per_shard, (i + 1) * samples_per_shard) of the split, concatenated along tokens, with `offsets` to cut
them apart. Next to each shard a small `shard-00000.json` records its checksum once the shard is fully written: a
shard counts as complete only when both exist and the checksum matches, which is how a rerun knows what to skip.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from draftline.extract.storage import Storage

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TENSOR_NAMES = ("input_ids", "loss_mask", "aux_hidden", "final_hidden", "offsets", "sample_index")


def shard_file_name(shard_index: int) -> str:
    return f"shard-{shard_index:05d}.safetensors"


def shard_record_name(shard_index: int) -> str:
    return f"shard-{shard_index:05d}.json"


def num_shards(num_samples: int, samples_per_shard: int) -> int:
    return (num_samples + samples_per_shard - 1) // samples_per_shard


def shard_sample_range(shard_index: int, num_samples: int, samples_per_shard: int) -> range:
    return range(shard_index * samples_per_shard, min((shard_index + 1) * samples_per_shard, num_samples))


def shards_of_worker(rank: int, world_size: int, total_shards: int) -> list[int]:
    """Worker `rank` owns shards i with i mod world_size == rank, the same on every attempt."""
    return list(range(rank, total_shards, world_size))


class ShardError(RuntimeError):
    """A shard is missing, truncated or corrupt; the message names the file and the fix."""


class IncompatibleHiddenStates(ValueError):
    """Hidden states were extracted from another target, layer set or width than the caller expects."""


@dataclass
class EncodedShard:
    """A shard computed in memory, not yet written."""

    shard_index: int
    blob: bytes
    samples: int
    tokens: int
    first_sample: int
    compute_s: float  # forward passes + encoding
    started_unix: float


@dataclass
class ShardRecord:
    """What the writer knows about a finished shard; stored beside it and collected into the manifest."""

    file: str
    samples: int
    tokens: int
    first_sample: int
    bytes: int
    sha256: str
    compute_s: float
    write_s: float  # checksum + write
    started_unix: float
    finished_unix: float


def encode_shard(
    samples: Sequence[dict], sample_indices: Sequence[int], metadata: dict[str, str]
) -> tuple[bytes, int]:
    """Concatenate per-sample tensors (input_ids, loss_mask, aux_hidden, final_hidden) into one safetensors blob."""
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        "input_ids": torch.cat([s["input_ids"].to(torch.int64) for s in samples]),
        "loss_mask": torch.cat([s["loss_mask"].to(torch.uint8) for s in samples]),
        "aux_hidden": torch.cat([s["aux_hidden"] for s in samples]).contiguous(),
        "final_hidden": torch.cat([s["final_hidden"] for s in samples]).contiguous(),
        "offsets": offsets,
        "sample_index": torch.tensor(list(sample_indices), dtype=torch.int64),
    }
    # One metadata key holding sorted JSON: safetensors writes a metadata dict in hash order, which changes from run
    # to run, so bit-identical tensors would get another sha256 and look like new data to every cache above.
    header = {"draftline": json.dumps(metadata, sort_keys=True)}
    return save_safetensors(tensors, metadata=header), int(offsets[-1])


def write_shard(storage: Storage, shard: EncodedShard) -> ShardRecord:
    """Checksum, then the shard, then its record: a record never points at a shard that is not fully there."""
    write_started = time.perf_counter()
    record = ShardRecord(
        file=shard_file_name(shard.shard_index),
        samples=shard.samples,
        tokens=shard.tokens,
        first_sample=shard.first_sample,
        bytes=len(shard.blob),
        sha256=sha256_bytes(shard.blob),
        compute_s=shard.compute_s,
        write_s=0.0,
        started_unix=shard.started_unix,
        finished_unix=0.0,
    )
    storage.write_bytes(record.file, shard.blob)
    record.write_s = round(time.perf_counter() - write_started, 4)
    record.finished_unix = time.time()
    storage.write_bytes(shard_record_name(shard.shard_index), json.dumps(asdict(record), indent=2).encode())
    return record


def read_shard_record(storage: Storage, shard_index: int) -> ShardRecord | None:
    name = shard_record_name(shard_index)
    if not storage.exists(name):
        return None
    try:
        return ShardRecord(**json.loads(storage.read_bytes(name)))
    except (ValueError, TypeError):
        return None


def complete_shard_record(storage: Storage, shard_index: int, expected_samples: int) -> ShardRecord | None:
    """The shard's record if the shard is complete (record, file, size and sha256 all agree), else None."""
    record = read_shard_record(storage, shard_index)
    if record is None or record.samples != expected_samples:
        return None
    if storage.size_bytes(record.file) != record.bytes:
        return None
    if storage.sha256(record.file) != record.sha256:
        return None
    return record


TOKEN_ID_BYTES = 8  # input_ids, int64
LOSS_MASK_BYTES = 1  # uint8
PER_SAMPLE_BYTES = 16  # offsets and sample_index, int64 each


def hidden_bytes_per_token(num_aux: int, hidden_size: int, dtype: str) -> int:
    """The hidden-state payload of one token: n_aux aux states and the final hidden state, H values each."""
    return (num_aux + 1) * hidden_size * TORCH_DTYPES[dtype].itemsize


def stored_bytes_per_token(num_aux: int, hidden_size: int, dtype: str) -> int:
    """What a shard holds per token: the hidden payload plus the token id and its loss-mask byte."""
    return hidden_bytes_per_token(num_aux, hidden_size, dtype) + TOKEN_ID_BYTES + LOSS_MASK_BYTES


def estimated_split_bytes(
    num_samples: int, num_tokens: int, num_shards: int, num_aux: int, hidden_size: int, dtype: str
) -> int:
    """Shard bytes of a split before it is extracted (safetensors headers, a few hundred bytes a shard, left out;
    each shard's offsets start with a 0)."""
    per_token = stored_bytes_per_token(num_aux, hidden_size, dtype)
    return num_tokens * per_token + num_samples * PER_SAMPLE_BYTES + num_shards * TOKEN_ID_BYTES


def build_manifest(
    records: Sequence[ShardRecord],
    *,
    target_fingerprint: str,
    target_name: str,
    target_dtype: str,
    num_layers: int,
    hidden_size: int,
    aux_layer_ids: Sequence[int],
    dtype: str,
    dataset_hash: str,
    split: str,
    samples_per_shard: int,
    total_samples: int,
) -> dict:
    total_bytes = sum(r.bytes for r in records)
    total_tokens = sum(r.tokens for r in records)
    return {
        "format_version": FORMAT_VERSION,
        "target_fingerprint": target_fingerprint,
        "target_name": target_name,
        "target_dtype": target_dtype,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "aux_layer_ids": list(aux_layer_ids),
        # What SGLang's set_eagle3_layers_to_capture turns these ids into: the layers whose INPUT it captures.
        "sglang_capture_layers": [i + 1 for i in aux_layer_ids],
        "dtype": dtype,
        "dataset_hash": dataset_hash,
        "split": split,
        "samples_per_shard": samples_per_shard,
        "shards": [
            {"file": r.file, "samples": r.samples, "tokens": r.tokens, "first_sample": r.first_sample,
             "bytes": r.bytes, "sha256": r.sha256}
            for r in records
        ],
        "total_samples": total_samples,
        "total_tokens": total_tokens,
        "total_bytes": total_bytes,
        "bytes_per_token": total_bytes / total_tokens if total_tokens else 0.0,
        # The hidden-state payload alone (n_aux + 1 vectors of H), without token ids, masks and headers.
        "hidden_bytes_per_token": hidden_bytes_per_token(len(aux_layer_ids), hidden_size, dtype),
    }


def write_manifest(storage: Storage, manifest: dict) -> None:
    """Written last: its presence means every listed shard was complete."""
    storage.write_bytes(MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode())


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def redo_hint(location: str, file: str) -> str:
    return f"delete {location}/{file} and rerun `draftline extract` with the same config; it redoes only missing shards"


class HiddenStateShards:
    """Read one split's hidden states: `.manifest`, `.verify()`, `len()`, `[i]` -> dict of per-sample tensors."""

    def __init__(self, location: str | os.PathLike):
        self.storage = Storage(location)
        if not self.storage.exists(MANIFEST_NAME):
            raise ShardError(
                f"no {MANIFEST_NAME} in {self.storage.location}: extraction did not finish there. "
                "Run `draftline extract` (it resumes where it stopped) or point at <hidden_root>/<hash>/<split>"
            )
        self.manifest: dict = json.loads(self.storage.read_bytes(MANIFEST_NAME))
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise ShardError(
                f"{self.storage.uri(MANIFEST_NAME)}: format_version {self.manifest.get('format_version')} is not "
                f"{FORMAT_VERSION}; re-extract with this draftline version"
            )
        self._first_samples = [s["first_sample"] for s in self.manifest["shards"]]
        self._cached_shard: tuple[int, dict[str, torch.Tensor]] | None = None

    @property
    def location(self) -> str:
        return self.storage.location

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.manifest["aux_layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    def __len__(self) -> int:
        return int(self.manifest["total_samples"])

    def verify(self) -> None:
        """Checksum every shard; raise ShardError naming the first bad one and what to do."""
        for shard in self.manifest["shards"]:
            name = shard["file"]
            size = self.storage.size_bytes(name)
            if size is None:
                raise ShardError(f"shard {self.storage.uri(name)} is missing; {redo_hint(self.location, name)}")
            if "bytes" in shard and size != shard["bytes"]:
                raise ShardError(
                    f"shard {self.storage.uri(name)} is truncated or overwritten ({size} bytes, manifest says "
                    f"{shard['bytes']}); {redo_hint(self.location, name)}"
                )
            if self.storage.sha256(name) != shard["sha256"]:
                raise ShardError(f"shard {self.storage.uri(name)} is corrupt (sha256 mismatch); {redo_hint(self.location, name)}")

    def check_compatible(self, target_fingerprint: str, aux_layer_ids: Sequence[int], hidden_size: int) -> None:
        """Refuse hidden states from another target, layer set or width (the trainer calls this before training)."""
        manifest = self.manifest
        problems = []
        if manifest["target_fingerprint"] != target_fingerprint:
            problems.append(
                f"target fingerprint {manifest['target_fingerprint']} (target {manifest.get('target_name')!r}) != "
                f"{target_fingerprint}"
            )
        if list(manifest["aux_layer_ids"]) != list(aux_layer_ids):
            problems.append(f"aux_layer_ids {manifest['aux_layer_ids']} != {list(aux_layer_ids)}")
        if int(manifest["hidden_size"]) != int(hidden_size):
            problems.append(f"hidden_size {manifest['hidden_size']} != {hidden_size}")
        if problems:
            raise IncompatibleHiddenStates(
                f"hidden states in {self.location} were extracted for something else: {'; '.join(problems)}. "
                "Rerun `draftline extract` with the same target and extract.aux_layer_ids as training "
                "(the output goes to a new <hash> directory), and train on that"
            )

    def _load_shard(self, position: int) -> dict[str, torch.Tensor]:
        if self._cached_shard is not None and self._cached_shard[0] == position:
            return self._cached_shard[1]
        shard = self.manifest["shards"][position]
        name = shard["file"]
        try:
            blob = self.storage.read_bytes(name)
        except FileNotFoundError:
            raise ShardError(f"shard {self.storage.uri(name)} is missing; {redo_hint(self.location, name)}") from None
        # Checked on every read, not only when written: a shard changed in place (same size) must never be trained on.
        if sha256_bytes(blob) != shard["sha256"]:
            raise ShardError(
                f"shard {self.storage.uri(name)} is corrupt ({len(blob)} bytes, sha256 differs from {MANIFEST_NAME}); "
                f"{redo_hint(self.location, name)}"
            )
        try:
            tensors = load_safetensors(blob)
        except Exception as err:  # safetensors raises its own error types for truncated/garbled headers
            raise ShardError(
                f"shard {self.storage.uri(name)} cannot be read ({err}); {redo_hint(self.location, name)}"
            ) from None
        missing = [t for t in TENSOR_NAMES if t not in tensors]
        if missing:
            raise ShardError(f"shard {self.storage.uri(name)} lacks tensors {missing}; {redo_hint(self.location, name)}")
        self._cached_shard = (position, tensors)
        return tensors

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples in {self.location}")
        index %= len(self)
        position = bisect.bisect_right(self._first_samples, index) - 1
        tensors = self._load_shard(position)
        local = index - self._first_samples[position]
        start, end = int(tensors["offsets"][local]), int(tensors["offsets"][local + 1])
        return {
            "input_ids": tensors["input_ids"][start:end],
            "loss_mask": tensors["loss_mask"][start:end],
            "aux_hidden": tensors["aux_hidden"][start:end],
            "final_hidden": tensors["final_hidden"][start:end],
            "sample_index": int(tensors["sample_index"][local]),
        }
