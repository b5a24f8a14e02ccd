"""Reproducibility of the gate's verdict: the demo config's gate, N times, each in a fresh MLflow store.

    .venv/bin/python benchmarks/gate_repro.py --runs 5                     # configs/tiny-cpu.yaml
    .venv/bin/python benchmarks/gate_repro.py --runs 5 --drafter DIR       # gate an existing export
    .venv/bin/python benchmarks/gate_repro.py --runs 5 --demo              # the whole demo, fresh data dir each

Default: the target and the dataset are the demo's (bootstrapped and prepared once, cached by hash). The drafter is a
quick in-process fit (draftline.bench.quick_drafter) unless --drafter is given: this measures the gate, not training.
Each run registers the drafter as version 1 of a fresh MLflow store (so there is no champion, as in a fresh
`make demo`) and runs `run_gate` with the config's gate section.

--demo: each run is `make demo`'s command, `draftline run --config CONFIG`, on a fresh empty data dir (bootstrap,
prepare, extract, train, gate, promote, serve; nothing shared between runs), and the gate's record is read from that
run's summary.json. This is the issue-14 figure: the demo's verdict, N times from nothing.

Writes every run's verdict, rounds, intervals and machine load to --out (default benchmarks/gate_repro.json, or
benchmarks/gate_repro_demo.json with --demo).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))

from draftline.config import load_config  # noqa: E402
from draftline.utils import atomic_write_json  # noqa: E402


def register(cfg, drafter_dir: Path) -> str:
    import mlflow

    from draftline.tracking import register_version, setup_mlflow

    setup_mlflow(cfg)
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(drafter_dir), artifact_path="drafter")
    return register_version(cfg, run.info.run_id, "drafter")


def demo_run(config: str, overrides: list[str], data_dir: Path) -> dict:
    """One `draftline run` of the demo on an empty data dir; its gate record, stage times and wall time."""
    shutil.rmtree(data_dir, ignore_errors=True)
    command = [str(Path(sys.executable).with_name("draftline")), "run", "--config", config, *overrides,
               f"data_dir={data_dir}"]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall_s = round(time.perf_counter() - started, 1)
    summary_paths = list(data_dir.rglob("summary.json"))
    if result.returncode != 0 or not summary_paths:
        print(result.stdout[-4000:], flush=True)
        raise SystemExit(f"[gate-repro] `{' '.join(command)}` exited {result.returncode}")
    summary = json.loads(summary_paths[0].read_text())
    gate = summary["gate"]["outputs"]
    return {
        "verdict": gate["verdict"], "rounds": gate["rounds"], "intervals": gate["intervals"],
        "accept_length": gate["bench"]["accept_length"], "machine_load": gate["machine_load"],
        "promoted": summary.get("promote", {}).get("outputs"), "wall_s": wall_s,
        "stage_seconds": {name: round(stage["seconds"], 1) for name, stage in summary.items()},
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.yaml"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--drafter", help="drafter export dir (default: fit one quickly)")
    parser.add_argument("--fit-steps", type=int, default=300)
    parser.add_argument("--demo", action="store_true", help="run the whole demo on a fresh data dir each time")
    parser.add_argument("--demo-root", default=str(REPO / ".draftline-gate-repro"),
                        help="parent of the --demo runs' data dirs (each emptied before its run)")
    parser.add_argument("--out")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    args.out = args.out or str(REPO / "benchmarks" / ("gate_repro_demo.json" if args.demo else "gate_repro.json"))
    if args.demo:
        runs = []
        for index in range(args.runs):
            run = {"run": index + 1, **demo_run(args.config, args.overrides, Path(args.demo_root) / f"run{index + 1}")}
            runs.append(run)
            print(f"[gate-repro] demo run {index + 1}: {run['verdict']} after {run['rounds']} rounds, intervals "
                  f"{run['intervals']}, load {run['machine_load']}, {run['wall_s']} s", flush=True)  # fmt: skip
            atomic_write_json(args.out, {"config": args.config, "overrides": args.overrides, "mode": "demo",
                                         "gate": load_config(args.config, args.overrides).gate.model_dump(),
                                         "host_cpus": os.cpu_count(), "runs": runs})  # fmt: skip
        verdicts = {run["verdict"] for run in runs}
        print(f"[gate-repro] {len(runs)} demo runs, verdicts {sorted(verdicts)}")
        return 0 if len(verdicts) == 1 else 1

    torch.set_num_threads(1)
    base_cfg = load_config(args.config, args.overrides)
    drafter_dir = Path(args.drafter) if args.drafter else None
    if drafter_dir is None:
        from draftline.bench.quick_drafter import quick_drafter
        from draftline.data.prepare import prepare
        from draftline.target.load import resolve_target_dir

        target_dir = resolve_target_dir(base_cfg)
        drafter_dir = quick_drafter(base_cfg, target_dir, prepare(base_cfg, target_dir), steps=args.fit_steps)
    from draftline.gate import run_gate

    runs = []
    for index in range(args.runs):
        with tempfile.TemporaryDirectory() as store:
            cfg = load_config(args.config, [*args.overrides, f"tracking.tracking_uri=sqlite:///{store}/mlflow.db",
                                            f"tracking.artifact_location={Path(store, 'mlruns').as_uri()}"])  # fmt: skip
            version = register(cfg, drafter_dir)
            started = time.perf_counter()
            decision = run_gate(cfg, version, log=lambda line: print(line, flush=True))
            record = decision.to_record().to_dict()
            runs.append({
                "run": index + 1, "verdict": decision.verdict, "rounds": decision.rounds,
                "intervals": record["intervals"], "accept_length": record["bench"]["accept_length"],
                "machine_load": record["machine_load"], "seconds": round(time.perf_counter() - started, 1),
            })  # fmt: skip
            print(f"[gate-repro] run {index + 1}: {decision.verdict} after {decision.rounds} rounds, "
                  f"intervals {record['intervals']}, load {record['machine_load']}", flush=True)  # fmt: skip
            atomic_write_json(args.out, {"config": args.config, "overrides": args.overrides,
                                         "drafter_dir": str(drafter_dir), "gate": cfg.gate.model_dump(), "runs": runs})  # fmt: skip
    verdicts = {run["verdict"] for run in runs}
    print(f"[gate-repro] {len(runs)} runs, verdicts {sorted(verdicts)}")
    return 0 if len(verdicts) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
