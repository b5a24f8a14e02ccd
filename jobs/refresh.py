"""Ray job: refresh the champion from captured traffic (docs/refresh.md).

ray job submit --working-dir . -- python jobs/refresh.py --config configs/tiny-cpu.yaml [--no-promote] [KEY=VALUE ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform"))

from draftline.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["refresh", *sys.argv[1:]]))
