"""What the preflight needs from a model directory: config.json and tensor shapes from safetensors headers.

Only the JSON header of each `.safetensors` file is read (8-byte little-endian length, then JSON), so a
multi-gigabyte checkpoint costs a few kilobytes of I/O and no tensors are loaded.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit on the header


@dataclass
class CheckpointInfo:
    path: Path
    written_as: str = ""
    config: Optional[dict] = None
    problem: Optional[str] = None  # why the directory could not be checked
    d2t_length: Optional[int] = None
    d2t_file: Optional[str] = None
    tensor_shapes: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_local(self) -> bool:
        """Written as a filesystem path (a hub id like org/name is not, and is not checked offline)."""
        return self.written_as.startswith(("/", ".", "~")) or self.path.exists()

    @property
    def architectures(self) -> list[str]:
        return list((self.config or {}).get("architectures") or [])

    @property
    def architecture(self) -> Optional[str]:
        return self.architectures[0] if self.architectures else None


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the file's header alone."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {header_len} is not plausible; not a safetensors file?")
        header = json.loads(f.read(header_len))
    return {name: list(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}


def read_checkpoint(raw_path: str | Path) -> CheckpointInfo:
    path = Path(raw_path).expanduser()
    info = CheckpointInfo(path=path, written_as=str(raw_path))
    if not path.is_dir():
        info.problem = "no such local directory"
        return info
    config_file = path / "config.json"
    try:
        info.config = json.loads(config_file.read_text())
    except FileNotFoundError:
        info.problem = "has no config.json"
        return info
    except json.JSONDecodeError as err:
        info.problem = f"config.json is not valid JSON (line {err.lineno}: {err.msg})"
        return info
    for weights in sorted(path.glob("*.safetensors")):
        try:
            shapes = safetensors_shapes(weights)
        except (OSError, ValueError) as err:
            info.problem = f"cannot read the safetensors header of {weights.name}: {err}"
            continue
        info.tensor_shapes.update(shapes)
        for name, shape in shapes.items():
            if name.split(".")[-1] == "d2t" and shape:
                info.d2t_length, info.d2t_file = shape[0], weights.name
    return info
