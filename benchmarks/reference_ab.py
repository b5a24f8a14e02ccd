"""The reference engine at two commits, side by side: CPU time per cell in paired rounds, and the same outputs.

    .venv/bin/python benchmarks/reference_ab.py --before REV [--rounds 8] [KEY=VALUE ...]

`--before` is a git revision; its `platform/` is unpacked to a temporary directory and run by a second worker
process beside one running this checkout's `platform/`. Both workers load the same target and drafter once (a
`quick_drafter` fit, cached), then each round runs every cell (speculative config x concurrency, every bench prompt,
greedy unless --temperature) on both, in alternating order (ABBA), so a burst of load lands on both sides of a
pair. A cell's cost is the worker's CPU time (time.process_time: every thread of the process) for the whole load;
the report gives per cell the ratio after/before of the summed CPU time with a bootstrap interval over rounds,
the accept lengths of both sides and whether every output token is the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPECS = {"chain 3/1/4": (3, 1, 4), "tree 3/2/6": (3, 2, 6)}
CONCURRENCY = (1, 4)


def spec_overrides(spec: tuple[int, int, int]) -> list[str]:
    steps, topk, draft_tokens = spec
    return [f"engine.speculative.num_steps={steps}", f"engine.speculative.eagle_topk={topk}",
            f"engine.speculative.num_draft_tokens={draft_tokens}"]  # fmt: skip


# ------------------------------------------------------------------------------------------------ the worker


def worker(setup: dict) -> None:
    """Load one engine per spec from whatever `draftline` is on PYTHONPATH; answer one cell per stdin line."""
    import torch

    from draftline.config import load_config
    from draftline.engines import make_engine
    from draftline.engines.base import SamplingParams

    torch.set_num_threads(1)
    replies = os.fdopen(os.dup(1), "w")  # the protocol's channel; anything the libraries print goes to stderr
    os.dup2(2, 1)
    engines = {}
    for name, spec in SPECS.items():
        cfg = load_config(setup["config"], setup["overrides"] + spec_overrides(spec) + ["engine.cpu_threads=1"])
        engines[name] = make_engine(cfg, setup["target_dir"], setup["drafter_dir"], model_version="ab")
        engines[name].load()
    params = SamplingParams(max_new_tokens=setup["max_new_tokens"], temperature=setup["temperature"], seed=0)
    prompts = setup["prompts"]
    print(json.dumps({"ready": os.getpid()}), file=replies, flush=True)
    for line in sys.stdin:
        cell = json.loads(line)
        engine = engines[cell["spec"]]
        cpu_s, wall_s = time.process_time(), time.perf_counter()
        outputs, steps, accepted = asyncio.run(run_load(engine, prompts, params, cell["concurrency"]))
        cpu_s, wall_s = time.process_time() - cpu_s, time.perf_counter() - wall_s
        result = {"cpu_s": cpu_s, "wall_s": wall_s, "outputs": outputs, "verify_steps": steps, "accepted": accepted}
        print(json.dumps(result), file=replies, flush=True)


async def run_load(engine, prompts: list[list[int]], params, concurrency: int):
    gate = asyncio.Semaphore(concurrency)

    async def one(ids):
        async with gate:
            tokens, stats = [], None
            async for chunk in engine.generate(ids, params):
                tokens += chunk.token_ids
                stats = chunk.stats or stats
            return tokens, stats

    done = await asyncio.gather(*(one(ids) for ids in prompts))
    outputs = [tokens for tokens, _ in done]
    return outputs, sum(s.verify_steps for _, s in done), sum(s.accepted_draft_tokens for _, s in done)


# ------------------------------------------------------------------------------------------------ the parent


class Worker:
    def __init__(self, label: str, platform_dir: Path, setup: dict) -> None:
        self.label = label
        env = {**os.environ, "PYTHONPATH": str(platform_dir), "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.process.stdin.write(json.dumps(setup) + "\n")
        self.process.stdin.flush()
        self._read()

    def run(self, spec: str, concurrency: int) -> dict:
        self.process.stdin.write(json.dumps({"spec": spec, "concurrency": concurrency}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.label} worker (pid {self.process.pid}) exited with {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def unpack_platform(revision: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "platform"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "platform"


def ratio_interval(before: list[float], after: list[float], samples: int = 10000, seed: int = 0) -> dict:
    """Summed after / summed before CPU time, with a 95% percentile bootstrap over paired rounds."""
    import numpy as np

    before_s, after_s = np.array(before), np.array(after)
    picks = np.random.default_rng(seed).integers(0, len(before_s), size=(samples, len(before_s)))
    ratios = after_s[picks].sum(axis=1) / before_s[picks].sum(axis=1)
    return {"ratio": round(float(after_s.sum() / before_s.sum()), 4),
            "interval": [round(float(np.percentile(ratios, 2.5)), 4), round(float(np.percentile(ratios, 97.5)), 4)]}  # fmt: skip


def prepared_inputs(args) -> dict:
    sys.path.insert(0, str(REPO / "platform"))
    from draftline.bench.quick_drafter import quick_drafter
    from draftline.config import load_config
    from draftline.data.prepare import load_split, prepare
    from draftline.target.load import resolve_target_dir

    cfg = load_config(args.config, args.overrides)
    target_dir = resolve_target_dir(cfg)
    dataset_dir = prepare(cfg, target_dir)
    drafter_dir = quick_drafter(cfg, target_dir, dataset_dir, steps=args.fit_steps)
    samples = load_split(dataset_dir, "bench")[: args.num_prompts]
    prompts = [s["input_ids"][: s["loss_mask"].index(1)] for s in samples if 1 in s["loss_mask"]]
    return {"config": args.config, "overrides": args.overrides, "target_dir": str(target_dir),
            "drafter_dir": str(drafter_dir), "prompts": prompts, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--before", help="git revision to compare this checkout against")
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.yaml"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--fit-steps", type=int, default=200)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reference_ab.json"))
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(sys.stdin.readline()))
        return 0
    if not args.before:
        parser.error("--before REV is required")
    setup = prepared_inputs(args)
    cells = [(spec, concurrency) for spec in SPECS for concurrency in CONCURRENCY]
    samples: dict = {f"{spec} c={c}": {"before": [], "after": []} for spec, c in cells}
    loads = []
    with tempfile.TemporaryDirectory() as scratch:
        sides = {"before": Worker("before", unpack_platform(args.before, Path(scratch)), setup),
                 "after": Worker("after", REPO / "platform", setup)}  # fmt: skip
        try:
            for round_index in range(args.rounds):
                loads.append(os.getloadavg()[0])
                for cell_index, (spec, concurrency) in enumerate(cells):
                    order = ["before", "after"] if (round_index + cell_index) % 2 == 0 else ["after", "before"]
                    for side in order:
                        samples[f"{spec} c={concurrency}"][side].append(sides[side].run(spec, concurrency))
                print(f"[ab] round {round_index + 1}/{args.rounds} done (load {loads[-1]:.1f})", flush=True)
        finally:
            for side in sides.values():
                side.close()
    report = {"before": args.before, "after": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
              capture_output=True, text=True).stdout.strip(), "rounds": args.rounds,
              "prompts": len(setup["prompts"]), "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "load_avg_1m": [min(loads), max(loads)], "cells": {}}  # fmt: skip
    for name, runs in samples.items():
        before, after = runs["before"], runs["after"]
        report["cells"][name] = {
            "cpu_ratio_after_over_before": ratio_interval([r["cpu_s"] for r in before], [r["cpu_s"] for r in after]),
            "cpu_s_per_round": {"before": round(sum(r["cpu_s"] for r in before) / len(before), 3),
                                "after": round(sum(r["cpu_s"] for r in after) / len(after), 3)},  # fmt: skip
            "accept_length": {side: round(sum(len(o) for o in r[0]["outputs"]) / r[0]["verify_steps"], 4)
                              for side, r in runs.items()},  # fmt: skip
            "same_outputs": all(b["outputs"] == a["outputs"] for b, a in zip(before, after)),
        }
    print(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
