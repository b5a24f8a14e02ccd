"""The traffic store: append-only, rotated, checksummed shards of served requests under <data_dir>/traffic.

A shard is a text file of lines `<sha256 of the JSON, 64 hex> <one record as JSON>`, so a damaged or torn line is
found record by record (`scan_store`) and a reader skips it (`read_records`). Files are mode 0600 and the directory
0700: the records hold user prompts. The store is a local directory only and is never logged to MLflow.

`read_records` is the seam for a later stage (a refresh pipeline): it yields the intact records of every shard,
oldest shard first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from draftline.config import DraftlineConfig

logger = logging.getLogger("ray.serve")

SHARD_SUFFIX = ".jsonl"
SHARD_PATTERN = re.compile(r"^traffic-\d{8}T\d{6}-[0-9a-f]{8}-\d{6}\.jsonl$")
FILE_MODE = 0o600
DIR_MODE = 0o700


def traffic_dir(cfg: DraftlineConfig) -> Path:
    """serve.traffic.dir, default <data_dir>/traffic."""
    configured = cfg.serve.traffic.dir
    return Path(configured).expanduser().resolve() if configured else cfg.data_path("traffic")


def encode_line(record: dict) -> bytes:
    payload = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return f"{hashlib.sha256(payload.encode()).hexdigest()} {payload}\n".encode()


def decode_line(line: bytes) -> Optional[dict]:
    """The record of one shard line, or None when its checksum does not match (or the line is torn)."""
    text = line.decode("utf-8", errors="replace").rstrip("\n")
    digest, _, payload = text.partition(" ")
    if len(digest) != 64 or hashlib.sha256(payload.encode()).hexdigest() != digest:
        return None
    try:
        record = json.loads(payload)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def shard_paths(directory: Path) -> list[Path]:
    """The store's shards, oldest first (names start with their UTC creation time)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and SHARD_PATTERN.match(p.name))


@dataclass
class ShardCheck:
    path: Path
    records: int
    bad_lines: list[int]  # 1-based line numbers whose checksum does not match
    size_bytes: int
    modified_s: float


def check_shard(path: Path) -> ShardCheck:
    records, bad = 0, []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if decode_line(line) is None:
                bad.append(number)
            else:
                records += 1
    stat = path.stat()
    return ShardCheck(path, records, bad, stat.st_size, stat.st_mtime)


def read_records(directory: Path, on_bad_line: Optional[Callable[[Path, int], None]] = None) -> Iterator[dict]:
    """Every intact record in the store, oldest shard first; a line whose checksum fails is skipped (and passed to
    `on_bad_line(shard, line number)`)."""
    for path in shard_paths(directory):
        with path.open("rb") as handle:
            for number, line in enumerate(handle, start=1):
                record = decode_line(line)
                if record is None:
                    if on_bad_line is not None:
                        on_bad_line(path, number)
                    continue
                yield record


@dataclass
class StoreStats:
    directory: Path
    shards: list[ShardCheck] = field(default_factory=list)

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shards)

    @property
    def damaged(self) -> list[ShardCheck]:
        return [s for s in self.shards if s.bad_lines]


def scan_store(directory: Path) -> StoreStats:
    return StoreStats(directory, [check_shard(p) for p in shard_paths(directory)])


def purge(directory: Path, older_than_s: Optional[float] = None, now_s: Optional[float] = None,
          keep: frozenset[Path] = frozenset()) -> list[Path]:
    """Delete shards last written more than `older_than_s` ago (None: every shard); returns what was deleted.

    `keep` (a writer's open shard) is left alone."""
    now_s = time.time() if now_s is None else now_s
    deleted = []
    for path in shard_paths(directory):
        if path in keep:
            continue
        try:
            if older_than_s is None or now_s - path.stat().st_mtime > older_than_s:
                path.unlink()
                deleted.append(path)
        except FileNotFoundError:  # another purge or the writer's retention got there first
            continue
    return deleted


def trim_to_size(directory: Path, max_total_bytes: int, keep: frozenset[Path] = frozenset()) -> list[Path]:
    """Delete the oldest shards (never those in `keep`) until the store holds at most `max_total_bytes`."""
    shards = [(p, p.stat().st_size) for p in shard_paths(directory)]
    total = sum(size for _, size in shards)
    deleted = []
    for path, size in shards:
        if total <= max_total_bytes:
            break
        if path in keep:
            continue
        path.unlink(missing_ok=True)
        deleted.append(path)
        total -= size
    return deleted


def ensure_private_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, DIR_MODE)


class ShardWriter:
    """Appends records to the newest shard, rotating past `shard_bytes`, and applies retention by age and size.

    Write errors (a full disk, a removed directory) raise OSError to the caller, which drops and counts the records;
    the shard is reopened on the next append."""

    RETENTION_EVERY_S = 60.0

    def __init__(self, directory: Path, shard_bytes: int, max_age_s: float, max_total_bytes: int) -> None:
        self.directory = directory
        self.shard_bytes = shard_bytes
        self.max_age_s = max_age_s
        self.max_total_bytes = max_total_bytes
        self.writer_id = uuid.uuid4().hex[:8]
        self._sequence = 0
        self._fd: Optional[int] = None
        self._path: Optional[Path] = None
        self._size = 0
        self._retention_at_s = 0.0

    @property
    def current(self) -> Optional[Path]:
        return self._path

    def append(self, records: list[dict]) -> None:
        data = b"".join(encode_line(r) for r in records)
        fd = self._open_shard()
        try:
            written = os.write(fd, data)
            if written != len(data):  # a short write on a nearly full disk: the line is torn, start a new shard
                raise OSError(f"short write to {self._path}: {written} of {len(data)} bytes")
        except OSError:
            self.close()
            raise
        self._size += len(data)
        if self._size >= self.shard_bytes:
            self.close()
        if time.monotonic() - self._retention_at_s > self.RETENTION_EVERY_S:
            self.apply_retention()

    def apply_retention(self) -> list[Path]:
        self._retention_at_s = time.monotonic()
        keep = frozenset({self._path}) if self._path else frozenset()
        deleted = purge(self.directory, self.max_age_s, keep=keep) + trim_to_size(self.directory, self.max_total_bytes, keep)
        if deleted:
            logger.info("traffic retention deleted %d shard(s) from %s", len(deleted), self.directory)
        return deleted

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._path, self._size = None, None, 0

    def _open_shard(self) -> int:
        if self._fd is not None and os.fstat(self._fd).st_nlink == 0:
            self.close()  # purged while open: writing on would lose the records in an unlinked file
        if self._fd is None:
            ensure_private_dir(self.directory)
            self._sequence += 1
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            self._path = self.directory / f"traffic-{stamp}-{self.writer_id}-{self._sequence:06d}{SHARD_SUFFIX}"
            self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
            os.fchmod(self._fd, FILE_MODE)  # whatever the umask
            self._size = 0
        return self._fd
