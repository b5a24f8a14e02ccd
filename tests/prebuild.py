"""Build what nearly every test of every tier shares, once, before pytest starts: the test target, its dataset and
the fitted drafter (the session fixtures of conftest.py find them in the shared test data dir by hash).

Run by `make test` and each tier's target. Built here, with the whole machine and no per-test timeout, instead of
inside the first test that asks: there, under load, one build ran past the 900 s per-test timeout and failed every
test that shares it. A second run finds everything cached in seconds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import FITTED_DRAFTER_STEPS, make_test_config  # noqa: E402
from draftline.bench.quick_drafter import quick_drafter  # noqa: E402
from draftline.data.prepare import prepare  # noqa: E402
from draftline.target.bootstrap import bootstrap_target  # noqa: E402


def main() -> int:
    started = time.monotonic()
    cfg = make_test_config()
    target_dir = bootstrap_target(cfg)
    dataset_dir = prepare(cfg, target_dir)
    drafter_dir = quick_drafter(cfg, target_dir, dataset_dir, steps=FITTED_DRAFTER_STEPS)
    print(f"test fixtures ready in {time.monotonic() - started:.0f} s: {target_dir}, {dataset_dir}, {drafter_dir}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
