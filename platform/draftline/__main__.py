"""`python -m draftline ...`: the CLI, where no `draftline` script is installed (a Ray job's entrypoint)."""

import sys

from draftline.cli import main

sys.exit(main())
