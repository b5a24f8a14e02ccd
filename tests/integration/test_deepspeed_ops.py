"""DeepSpeed's CPU shared-memory op (draftline.train.deepspeed_ops): a process killed while it holds torch's build
lock no longer makes every later DeepSpeed init on the machine wait forever."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from draftline.train.deepspeed_ops import OP_NAME, ensure_shm_comm_op, extensions_dir

# What torch's cpp_extension.load does first when it builds an extension: take its lock file (FileBaton) in the
# build directory. The process is then SIGKILLed, as an OOM kill or a lost node ends a worker compiling the op.
TAKE_TORCH_LOCK = "import sys, time; from torch.utils.file_baton import FileBaton\n" \
                  "assert FileBaton(sys.argv[1]).try_acquire(); print('held', flush=True); time.sleep(600)"


def copy_of_the_built_op(tmp_path):
    """A cache of the test's own (for XDG_CACHE_HOME) holding a copy of this installation's op, built at `make setup`:
    loading it needs no compiler run."""
    assert ensure_shm_comm_op() is not None
    cache = tmp_path / "cache"
    shutil.copytree(extensions_dir(), cache / "torch_extensions" / extensions_dir().name)
    return cache


def test_a_killed_holder_of_the_build_lock_does_not_stop_the_next_init(tmp_path):
    """Without draftline's own lock and stale-lock check, the second process waits forever in torch's
    FileBaton.wait (seen: two test workers hung 10 minutes until the lock was removed by hand)."""
    cache = copy_of_the_built_op(tmp_path)
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    lock = cache / "torch_extensions" / extensions_dir().name / OP_NAME / "lock"

    holder = subprocess.Popen([sys.executable, "-c", TAKE_TORCH_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    assert lock.exists(), "the killed holder's lock file should be left behind, as torch leaves it"

    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "draftline.train.deepspeed_ops"], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    print(f"op loaded past the stale lock in {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"removed a stale DeepSpeed build lock {lock}" in done.stderr + done.stdout
    assert not lock.exists()


def test_a_caller_whose_path_finds_another_ninja_does_not_rebuild_the_op(tmp_path):
    """torch runs the first `ninja` on PATH. Two ninja versions (the system's, and DeepSpeed's own beside the venv's
    interpreter) read each other's build log as invalid and rebuild the op from scratch: before the fix a Ray job whose
    PATH put the venv first rebuilt what `make setup` had built (minutes of two compilers), while every other
    DeepSpeed init waited for the lock. Loads from callers with either PATH must find the op built."""
    cache = copy_of_the_built_op(tmp_path)
    library = cache / "torch_extensions" / extensions_dir().name / OP_NAME / f"{OP_NAME}.so"
    venv_first = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    system_only = os.pathsep.join(["/usr/bin", "/bin"])

    def load(path: str) -> int:
        env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PATH": path}
        done = subprocess.run([sys.executable, "-m", "draftline.train.deepspeed_ops"], env=env, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return library.stat().st_mtime_ns

    built = load(venv_first)  # rebuilds only an op built by another ninja before this fix
    assert load(system_only) == built, "a caller whose PATH finds the system's ninja rebuilt the op"
    assert load(venv_first) == built, "a caller whose PATH finds the venv's ninja rebuilt the op"
