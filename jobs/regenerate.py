"""Ray job: `ray job submit --working-dir . -- python jobs/regenerate.py --config configs/tiny-cpu.yaml [KEY=VALUE ...]`.

The same as `draftline regenerate`: it connects to RAY_ADDRESS, or starts a local Ray on 127.0.0.1.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform"))

from draftline.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["regenerate", *sys.argv[1:]]))
