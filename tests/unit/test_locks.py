"""utils.file_lock: a lock no dead process can leave behind, and a wait that ends with the holder's pid."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from draftline.utils import LockTimeoutError, file_lock

HOLD = "import sys, time; from draftline.utils import file_lock\nwith file_lock(sys.argv[1], 5, 'x'):\n    print('held', flush=True); time.sleep(600)"


def _holder(path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_waiter_gives_up_at_its_deadline_naming_the_lock_and_its_holder(tmp_path):
    lock = tmp_path / "build.lock"
    holder = _holder(lock)
    try:
        with pytest.raises(LockTimeoutError) as raised, file_lock(lock, 0.5, "the build of X"):
            pass
        assert f"waited 0.5 s for the build of X: the lock {lock} is held by pid {holder.pid}" in str(raised.value)
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_holder_is_free_at_once(tmp_path):
    lock = tmp_path / "build.lock"
    holder = _holder(lock)
    holder.kill()
    holder.wait()
    with file_lock(lock, 0.5, "the build of X"):
        assert lock.read_text() == str(os.getpid())
