"""DeepSpeed's CPU shared-memory collective op, built once per installation and never waited for forever.

On a CPU machine DeepSpeed JIT-builds its `deepspeed_shm_comm` op (a C++ extension) at every first init in a process,
through torch's cpp_extension, which guards the build directory with a lock *file* that only its creator removes. A
process killed while it holds that file (an OOM kill of a worker compiling it, a lost node, a test's SIGKILL) leaves
it behind, and every later DeepSpeed init on the machine then waits for it forever, silently. So draftline:
- builds the op into a directory of its own per installation (the DeepSpeed and torch it runs with), at `make setup`
  and otherwise at the first training run, so two installations never rebuild into one directory in turn;
- takes its own lock around the load (an fcntl lock, which the kernel releases when its holder dies however it dies),
  so a torch lock file found while holding it has no live owner: it is reported and removed;
- waits for that lock under a deadline whose error names the lock and its holder;
- builds with the installation's own ninja (DeepSpeed's dependency, beside the interpreter), whatever the caller's PATH:
  torch runs the first `ninja` on PATH, and two ninja versions read each other's build log as invalid and rebuild
  everything (seen: a Ray job whose PATH put the venv first rebuilt the op that `make setup` had built with the
  system's ninja, and every other DeepSpeed init on the machine waited three minutes for the lock).
DeepSpeed caches a loaded op per process, so its own init afterwards finds it loaded and takes no lock.

`python -m draftline.train.deepspeed_ops` builds it (the Makefile's setup does).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

from draftline.utils import environment_restored, file_lock, stable_hash

logger = logging.getLogger(__name__)

OP_NAME = "deepspeed_shm_comm"
# A cold build takes about a minute on 2 busy cores; a holder past this is stuck, not slow.
BUILD_DEADLINE_S = 900.0


def extensions_dir() -> Path:
    """This installation's torch extensions directory: one per (DeepSpeed install path and version, torch, Python)."""
    import deepspeed  # lazy: DeepSpeed's import is heavy and only training needs it
    import torch

    # The path as imported, not resolved: torch's build files name the sources by it, so two paths to one install
    # (a linked venv) would rebuild into one directory in turn.
    installation = stable_hash(deepspeed.__file__, deepspeed.__version__, torch.__version__, sys.version_info[:2])[:16]
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions" / f"draftline-{installation}"


def remove_stale_torch_lock(build_dir: Path) -> bool:
    """Called while holding draftline's lock: a torch lock file in the op's build directory then has no live owner
    (every builder of this directory holds draftline's lock first). Reports and removes it; True if there was one."""
    stale = build_dir / "lock"
    if not stale.exists():
        return False
    logger.warning("removed a stale DeepSpeed build lock %s: the process that held it died while building %s; "
                   "without this every DeepSpeed init on this machine would wait for it forever", stale, OP_NAME)
    stale.unlink(missing_ok=True)
    return True


@contextlib.contextmanager
def installation_ninja_first() -> Iterator[None]:
    """PATH with this interpreter's directory first while its ninja builds the op (unchanged where it has none)."""
    own = os.path.dirname(sys.executable)
    with environment_restored("PATH"):
        if shutil.which("ninja", path=own):
            os.environ["PATH"] = os.pathsep.join(p for p in (own, os.environ.get("PATH")) if p)
        yield


def ensure_shm_comm_op(deadline_s: float = BUILD_DEADLINE_S):
    """Build (or load) DeepSpeed's shared-memory op for this process before `deepspeed.initialize`; returns the loaded
    module, or None where DeepSpeed does not use it (not a CPU accelerator, or an op DeepSpeed marks incompatible)."""
    from deepspeed.accelerator import get_accelerator  # lazy: as above
    from deepspeed.comm.torch import build_shm_op

    if get_accelerator().create_op_builder("ShareMemCommBuilder") is None:
        return None
    directory = extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(directory)
    with file_lock(directory / "draftline-build.lock", deadline_s, f"the build of DeepSpeed's {OP_NAME} op in {directory}"):
        remove_stale_torch_lock(directory / OP_NAME)
        with installation_ninja_first():
            return build_shm_op()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = ensure_shm_comm_op()
    print(f"DeepSpeed {OP_NAME}: {'built in ' + str(extensions_dir()) if module is not None else 'not used here'}")
