"""Where hidden states live: a local directory or an object store URI (s3://, gs://, ...), through `pyarrow.fs`."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pyarrow.fs as pafs

from draftline.utils import is_uri, raise_if_storage_full

_READ_CHUNK_BYTES = 8 << 20


class Storage:
    """A directory on some filesystem; every path below is relative to it."""

    def __init__(self, location: str | os.PathLike):
        location = str(location)
        if not is_uri(location):
            location = str(Path(location).expanduser().resolve())
        self.location = location.rstrip("/")
        self.fs, self.root = pafs.FileSystem.from_uri(self.location if is_uri(self.location) else Path(self.location).as_uri())
        # Local renames are atomic; on object stores an upload becomes visible only when it completes.
        self.rename_is_atomic = self.fs.type_name == "local"

    def child(self, *parts: str) -> "Storage":
        return Storage("/".join([self.location, *parts]))

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def uri(self, name: str = "") -> str:
        return f"{self.location}/{name}" if name else self.location

    def exists(self, name: str) -> bool:
        return self.fs.get_file_info(self.path(name)).type == pafs.FileType.File

    def size_bytes(self, name: str) -> int | None:
        info = self.fs.get_file_info(self.path(name))
        return info.size if info.type == pafs.FileType.File else None

    def mtime_ns(self, name: str) -> int | None:
        info = self.fs.get_file_info(self.path(name))
        return info.mtime_ns if info.type == pafs.FileType.File else None

    def list_files(self) -> dict[str, int]:
        """File name -> modification time (ns) for the files directly in this directory."""
        selector = pafs.FileSelector(self.root, allow_not_found=True, recursive=False)
        return {
            info.base_name: info.mtime_ns or 0 for info in self.fs.get_file_info(selector) if info.type == pafs.FileType.File
        }

    def list_names(self) -> list[str]:
        return sorted(self.list_files())

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write so that a reader sees the whole file or no file, never a partial one."""
        with raise_if_storage_full(self.uri(name), "data_dir (or extract.storage_uri)", "complete shards are kept"):
            self._write_bytes(name, data)

    def _write_bytes(self, name: str, data: bytes) -> None:
        self.fs.create_dir(self.root, recursive=True)
        if not self.rename_is_atomic:
            with self.fs.open_output_stream(self.path(name)) as handle:
                handle.write(data)
            return
        tmp_name = f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with self.fs.open_output_stream(self.path(tmp_name)) as handle:
                handle.write(data)
            with open(self.path(tmp_name), "rb+") as handle:
                os.fsync(handle.fileno())
            self.fs.move(self.path(tmp_name), self.path(name))
        except BaseException:
            self.delete(tmp_name)
            raise

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open_input_stream(self.path(name)) as handle:
            return handle.readall()

    def sha256(self, name: str) -> str:
        digest = hashlib.sha256()
        with self.fs.open_input_stream(self.path(name)) as handle:
            while chunk := handle.read(_READ_CHUNK_BYTES):
                digest.update(chunk)
        return digest.hexdigest()

    def delete(self, name: str) -> None:
        try:
            self.fs.delete_file(self.path(name))
        except FileNotFoundError:
            pass

    def remove_temp_files(self) -> int:
        """Delete what writers killed mid-write left behind (`.NAME.XXXX.tmp`)."""
        stale = [n for n in self.list_names() if n.startswith(".") and n.endswith(".tmp")]
        for name in stale:
            self.delete(name)
        return len(stale)
