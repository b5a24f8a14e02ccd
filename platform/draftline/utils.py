"""Small shared helpers: stable hashing, atomic writes, checksums, the full-disk rule."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

# Write errors no retry can fix: the disk is full, the quota is used up, the file system is read-only.
STORAGE_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


class StorageFullError(RuntimeError):
    """A write failed for want of space or write access; the one-line message names the file, the free space there
    and the fix. Every stage fails at once on it: a retry (Ray Train's included) would fail the same way."""


@contextmanager
def environment_restored(*names: str) -> Iterator[None]:
    """Whatever the block sets or removes of these environment variables, afterwards they are as before."""
    before = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def is_uri(location: str | os.PathLike) -> bool:
    return "://" in str(location)


def storage_full_message(location: str | os.PathLike, error_number: int, settings: str = "data_dir",
                         kept: str = "") -> str:
    """settings: what to point elsewhere (e.g. "data_dir (or extract.storage_uri)"); kept: what a rerun resumes from."""
    location = str(location)
    if location.startswith("file://"):  # MLflow's local artifact URIs
        location = location[len("file://"):]
    if is_uri(location):
        free = "free space unknown"
    else:
        existing = Path(location)
        while not existing.exists():
            existing = existing.parent
        free = f"{shutil.disk_usage(existing).free / 1e6:.1f} MB free there"
    return (f"cannot write {location}: {os.strerror(error_number)} ({free}); free space or point {settings} at a "
            f"writable disk with room, then rerun{': ' + kept if kept else ''}")


@contextmanager
def raise_if_storage_full(location: str | os.PathLike, settings: str = "data_dir", kept: str = "") -> Iterator[None]:
    """Turn a full-disk OSError raised while writing `location` into StorageFullError (other errors pass through)."""
    try:
        yield
    except OSError as err:
        if err.errno not in STORAGE_FULL_ERRNOS:
            raise
        raise StorageFullError(storage_full_message(location, err.errno, settings, kept)) from None


class StorageFullSink:
    """A Ray actor the workers of a Ray Train group tell about a full disk; the driver raises the first message
    (Ray Train retries any worker error, and a full disk is not one to retry)."""

    def __init__(self):
        self._messages: list[str] = []

    def add(self, message: str) -> None:
        self._messages.append(message)

    def messages(self) -> list[str]:
        return self._messages


def actor_on_driver_node(actor_class: type, *args: Any):
    """Start a bookkeeping actor of a run (a StorageFullSink, the online stream's cursor) on the driver's node, as Ray
    Train does with its controller: elsewhere, a worker node that dies would take it with it, and the run would
    fail after Ray Train had recovered (seen with a worker node SIGKILLed mid-extraction)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    on_driver_node = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0, scheduling_strategy=on_driver_node)(actor_class).remote(*args)


class LockTimeoutError(TimeoutError):
    """A lock another process held for longer than the caller's deadline; the message names the lock and its holder."""


# A cache entry's builder (a twin's training included) finishes well inside this; past it the holder is stuck.
BUILD_LOCK_DEADLINE_S = 3600.0


@contextmanager
def file_lock(path: str | os.PathLike, deadline_s: float, waiting_for: str) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `path` (created if missing). The kernel releases it when its holder dies, however
    it dies, so a lock is never left behind; the holder's pid is written into the file for the error a waiter raises
    after `deadline_s` ("waited ... for <waiting_for>: held by pid N")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    give_up_at = time.monotonic() + deadline_s
    with open(path, "a+") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= give_up_at:
                    handle.seek(0)
                    holder = handle.read().strip() or "unknown"
                    raise LockTimeoutError(
                        f"waited {deadline_s:g} s for {waiting_for}: the lock {path} is held by pid {holder}; "
                        "if that process is stuck, stop it and rerun") from None
                time.sleep(0.2)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def build_lock(out_dir: str | os.PathLike, deadline_s: float = BUILD_LOCK_DEADLINE_S) -> Iterator[None]:
    """Hold the lock of a cache entry (a built target, a prepared dataset, a fitted drafter) while checking and building
    it: a second draftline process on the same data_dir (another run, a parallel test) waits, then finds it built,
    instead of building it too and replacing the directory under the first one's readers. `.<name>.lock` beside it."""
    out_dir = Path(out_dir)
    with file_lock(out_dir.parent / f".{out_dir.name}.lock", deadline_s, f"the build of {out_dir}"):
        yield


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


# A query parameter whose name says it holds a secret (`?token=`, `access_token`, `api_key`, Azure SAS `sig`,
# `X-Amz-Signature`, `password`): its value is replaced.
_SECRET_QUERY_PARAM = re.compile(
    r"([?&;][^=&#\s]*(?:token|key|secret|passw|pwd|sig|credential|auth)[^=&#\s]*=)[^&#\s]*", re.IGNORECASE)
_URI_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/:@\s]*):[^@/\s]*@")


def redact_uri_credentials(text: str) -> str:
    """The one rule for credentials in URIs that draftline logs, prints or writes (the config, MLflow params, messages):
    `https://user:secret@host/x?token=abc&b=1` -> `https://user:***@host/x?token=***&b=1`."""
    return _SECRET_QUERY_PARAM.sub(r"\1***", _URI_PASSWORD.sub(r"\1:***@", text))


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
    with raise_if_storage_full(path):
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
