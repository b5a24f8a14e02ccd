"""Reference engine on CPU: speculative (EAGLE-3) vs target-only tokens/s, side by side in one run.

    .venv/bin/python benchmarks/engines.py                         # configs/tiny-cpu.yaml, greedy, sweep grid
    .venv/bin/python benchmarks/engines.py --drafter DIR           # an existing export instead of a quick fit

Without --drafter the script fits a drafter in-process (draftline.bench.quick_drafter: ttt_loss on the prepared
train split, cached under <data_dir>/quick-drafters/), so the numbers do not depend on the training stage.
Every configuration of bench.sweep_grid runs against the same target-only baseline on the bench split.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))

from draftline.bench.cli import run_bench  # noqa: E402
from draftline.bench.runner import format_table  # noqa: E402
from draftline.config import load_config  # noqa: E402
from draftline.utils import atomic_write_json  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.yaml"))
    parser.add_argument("--drafter", help="drafter export dir (default: fit one quickly)")
    parser.add_argument("--fit-steps", type=int, default=300)
    parser.add_argument("--torch-threads", type=int, default=1, help="1 avoids oversubscription on a shared CPU")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3, help="bench.rounds: repeat, keep each row's fastest")
    parser.add_argument("--no-sweep", action="store_true", help="only engine.speculative, not bench.sweep_grid")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "engines.json"))
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()

    torch.set_num_threads(args.torch_threads)  # the quick drafter fit; the engines read engine.cpu_threads
    cfg = load_config(args.config, [f"bench.rounds={args.rounds}", f"engine.cpu_threads={args.torch_threads}", *args.overrides])
    drafter_dir = Path(args.drafter) if args.drafter else None
    if drafter_dir is None:
        from draftline.bench.quick_drafter import quick_drafter
        from draftline.data.prepare import prepare
        from draftline.target.load import resolve_target_dir

        target_dir = resolve_target_dir(cfg)
        started = time.perf_counter()
        drafter_dir = quick_drafter(cfg, target_dir, prepare(cfg, target_dir), steps=args.fit_steps)
        print(f"[bench] drafter {drafter_dir} ready in {time.perf_counter() - started:.1f} s", flush=True)

    report = run_bench(cfg, [("eagle3", drafter_dir, None)], sweep=not args.no_sweep, temperature=args.temperature)
    report["machine"] = {
        "cpu_count": os.cpu_count(),
        "torch_threads": args.torch_threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    fit = drafter_dir / "quick_fit.json"
    if fit.exists():
        report["drafter_fit"] = json.loads(fit.read_text())
    print(format_table(report["rows"]))
    atomic_write_json(args.out, report)
    print(f"[bench] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
