"""A finished target directory: how a built (embedded) or imported (gguf) target is put in place under
`<data_dir>/targets/`, and the marker that says it is complete."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from draftline.config import DraftlineConfig, write_resolved
from draftline.utils import atomic_write_json

# The file whose presence marks a finished target directory; it holds the build's or import's summary.
DONE_MARKER = "bootstrap.json"


def publish_target_dir(cfg: DraftlineConfig, tmp_dir: Path, out_dir: Path, summary: dict) -> Path:
    """Write the resolved config and the marker (last) into tmp_dir, then move it to out_dir in one rename, so a
    killed build never leaves a directory that looks finished."""
    write_resolved(cfg, tmp_dir)
    atomic_write_json(tmp_dir / DONE_MARKER, summary)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp_dir, out_dir)
    print(f"[bootstrap-target] wrote {out_dir} in {summary['build_seconds']} s", flush=True)
    return out_dir
