"""Reference engine on CPU: speculative (EAGLE-3) vs target-only tokens/s, side by side in one run.

    .venv/bin/python benchmarks/engines.py                         # configs/tiny-cpu.yaml, greedy, engine.speculative
    .venv/bin/python benchmarks/engines.py --sweep                 # every bench.sweep_grid configuration
    .venv/bin/python benchmarks/engines.py --drafter DIR           # an existing export instead of a quick fit

Without --drafter the script fits a drafter in-process (draftline.bench.quick_drafter: ttt_loss on the prepared
train split, cached under <data_dir>/quick-drafters/), so the numbers do not depend on the training stage.
Every engine runs in paired, interleaved rounds (bench/runner.py) against the same target-only baseline on the
bench split. Besides the table the report holds "goals": tokens/s at the highest concurrency over the lowest per
engine (continuous batching), speedups with their intervals, and per-phase seconds (prefill, draft, verify, accept,
overhead) with the speedup bound they imply: the speedup if drafting cost nothing.
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

from draftline.bench.run import run_bench  # noqa: E402
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
    parser.add_argument("--rounds", type=int, default=5, help="bench.rounds: paired, interleaved rounds")
    parser.add_argument("--sweep", action="store_true", help="every bench.sweep_grid configuration, not only engine.speculative")
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

    report = run_bench(cfg, [("eagle3", drafter_dir, None)], sweep=args.sweep, temperature=args.temperature)
    report["goals"] = goals(report["rows"])
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
    print(json.dumps(report["goals"], indent=1))
    atomic_write_json(args.out, report)
    print(f"[bench] wrote {args.out}")
    return 0


def goals(rows: list[dict]) -> dict:
    """Concurrency scaling per engine, speedups, and where a speculative step's time goes."""
    levels = sorted({row["concurrency"] for row in rows})
    low, high = levels[0], levels[-1]
    by_key = {(row["label"], row["spec"], row["concurrency"]): row for row in rows}
    base_per_token_s = {
        c: by_key[("target-only", "-", c)]["wall_s"] / by_key[("target-only", "-", c)]["output_tokens"] for c in levels
    }
    out: dict = {"scaling": {}, "speedup": {}, "phases": {}}
    for (label, spec, concurrency), row in by_key.items():
        name = label if spec == "-" else f"{label} {spec}"
        if concurrency == high and (label, spec, low) in by_key:
            out["scaling"][f"{name}: tok/s c={high} / c={low}"] = round(
                row["output_tokens_per_s"] / by_key[(label, spec, low)]["output_tokens_per_s"], 3
            )
        if row["speedup"] is not None:
            out["speedup"][f"{name} c={concurrency}"] = {"estimate": row["speedup"], "interval": row["speedup_ci"]}
        phases = row.get("phase_s")
        if phases and phases["steps"]:
            per_step_ms = {k: round(1000 * v / phases["steps"], 3) for k, v in phases.items() if k != "steps"}
            entry = {"steps": phases["steps"], "tokens_per_step": round(row["output_tokens"] / phases["steps"], 3),
                     "ms_per_step": per_step_ms}  # fmt: skip
            if spec != "-":
                # drafting for free: only verify, accept, prefill and overhead remain
                rest_s = row["wall_s"] - phases["draft"]
                entry["speedup_if_draft_free"] = round(base_per_token_s[concurrency] * row["output_tokens"] / rest_s, 3)
            out["phases"][f"{name} c={concurrency}"] = entry
    return out


if __name__ == "__main__":
    sys.exit(main())
