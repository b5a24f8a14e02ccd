"""Small shared helpers: stable hashing, atomic writes, checksums."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Any


def stable_hash(*parts: Any) -> str:
    """A hex digest that is the same on every machine and Python run (unlike `hash()`)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(json.dumps(part, sort_keys=True, default=str).encode())
        digest.update(b"\x00")
    return digest.hexdigest()


def stable_fraction(key: str) -> float:
    """Map a key to [0, 1) deterministically; used for train/val/bench splits."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / float(16**12)


def split_of(key: str, val_fraction: float, bench_fraction: float) -> str:
    u = stable_fraction(key)
    if u < bench_fraction:
        return "bench"
    if u < bench_fraction + val_fraction:
        return "val"
    return "train"


def redact_uri_credentials(text: str) -> str:
    """`https://user:secret@host/x` -> `https://user:***@host/x`: configs are logged to MLflow, credentials must not be."""
    return re.sub(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/:@\s]*):[^@/\s]*@", r"\1:***@", text)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (servers, tests and other runs share this machine: never a fixed one)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _process_umask() -> int:
    # os.umask can only be read by setting it; done once, at import, before any thread writes files.
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


_UMASK = _process_umask()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> Path:
    """Write to a temp file in the same directory, fsync, then rename: readers never see a partial file.

    mode: permission bits set before anything is written (e.g. 0o600 for a secret). By default the file gets what
    open() would give it (0o666 less the umask), not mkstemp's 0o600: an engine running as another user on shared
    storage must be able to read an export."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode if mode is not None else 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> Path:
    return atomic_write_bytes(path, text.encode(), mode)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())
