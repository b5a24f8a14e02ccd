"""Ray job: `ray job submit --working-dir . -- python jobs/train.py --config configs/tiny-cpu.yaml [KEY=VALUE ...]`."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform"))

from draftline.cli import config_from_args  # noqa: E402
from draftline.config import ConfigError  # noqa: E402
from draftline.raycluster import ensure_ray  # noqa: E402
from draftline.train.cli import add_train_args, run_train  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description="draftline stage 4: train the drafter (Ray Train + DeepSpeed)")
    add_train_args(parser)
    args = parser.parse_args()
    try:
        cfg = config_from_args(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    ensure_ray(cfg)
    return run_train(cfg, args.hidden_dir, args.dataset_dir, args.target_dir)


if __name__ == "__main__":
    sys.exit(main())
