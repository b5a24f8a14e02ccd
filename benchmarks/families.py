"""One row per target family: the whole pipeline (bootstrap -> promote) on each shape twin (configs/twins/).

    .venv/bin/python benchmarks/families.py                       # every twin, its own config
    .venv/bin/python benchmarks/families.py --twins qwen3-8b      # some of them
    .venv/bin/python benchmarks/families.py train.max_steps=120   # overrides for every twin

Each twin runs `run_pipeline(cfg, from_stage="bootstrap", until="promote")` on a real local Ray cluster in its own data
dir (--data-dir/<twin>), so nothing is skipped from an earlier run except the twin's trained target, which bootstrap
builds once and caches by hash (the bootstrap column is that cold build's time, from its bootstrap.json). The row
holds the train stage's validation figures (val acc_0, estimated accept length), the gate's bench (measured accept
length, speedup at concurrency 1, lossless), how varied the twin's own replies are (distinct replies of all; a
degenerate twin makes acceptance trivially high) and each stage's wall time, side by side in one run on this machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))

from draftline.config import load_config  # noqa: E402
from draftline.utils import atomic_write_json  # noqa: E402

TWINS = sorted(p.stem for p in (REPO / "configs" / "twins").glob("*.yaml"))
STAGES = ["bootstrap", "prepare", "extract", "train", "gate", "promote"]


def replies(target_dir: str) -> dict:
    """How varied the twin's own replies are (a twin that answers "the the the" makes acceptance trivially high)."""
    texts = [json.loads(line)["messages"][-1]["content"] for line in open(Path(target_dir) / "conversations.jsonl")]
    words = [t.split() for t in texts]
    return {"replies": len(texts), "distinct_replies": len(set(texts)),
            "distinct_word_ratio": sum(len(set(w)) / max(1, len(w)) for w in words) / max(1, len(words))}  # fmt: skip


def row(name: str, summary: dict) -> dict:
    val = summary["train"]["outputs"]["metrics"]
    gate = summary["gate"]["outputs"]
    return {
        "twin": name,
        "val_acc_0": val["val_acc_0"],
        "val_est_accept_len": val["val_est_accept_len"],
        "accept_length": gate["bench"]["accept_length"],
        "speedup": gate["bench"]["speedup"],
        "speedup_interval": gate["intervals"]["speedup@1"],
        "lossless": gate["bench"]["lossless"],
        "gate": gate["verdict"],
        **replies(summary["bootstrap"]["outputs"]["target_dir"]),
        # bootstrap: the twin's cold build (bootstrap.json), whether or not this run found it cached
        "seconds": {**{stage: round(summary[stage]["seconds"], 1) for stage in STAGES},
                    "bootstrap": summary["bootstrap"]["outputs"]["build_seconds"]},
        "heldout_perplexity": summary["bootstrap"]["outputs"]["heldout_perplexity"],
    }


def table(rows: list[dict]) -> str:
    head = ["twin", "held-out ppl", "distinct replies", "val acc_0", "est accept", "measured accept",
            "speedup (interval)", "lossless", "gate", *(f"{s} s" for s in STAGES)]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        low, high = r["speedup_interval"]
        cells = [r["twin"], f"{r['heldout_perplexity']:.1f}", f"{r['distinct_replies']}/{r['replies']}",
                 f"{r['val_acc_0']:.3f}", f"{r['val_est_accept_len']:.2f}", f"{r['accept_length']:.2f}",
                 f"{r['speedup']:.2f} ({low:.2f}-{high:.2f})", str(r["lossless"]), r["gate"],
                 *(f"{r['seconds'][s]:.0f}" for s in STAGES)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--twins", nargs="*", default=TWINS, choices=TWINS)
    parser.add_argument("--data-dir", default="/tmp/draftline-families")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "families.json"))
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()

    from draftline.pipeline import run_pipeline
    from draftline.raycluster import ensure_ray

    ensure_ray(num_cpus=4)  # Ray Train's controller besides 2 workers, on a 2-core machine (as the tests do)
    rows = []
    for name in args.twins:
        cfg = load_config(REPO / "configs" / "twins" / f"{name}.yaml",
                          [f"data_dir={Path(args.data_dir) / name}", *args.overrides])  # fmt: skip
        started = time.monotonic()
        summary = run_pipeline(cfg, from_stage="bootstrap", until="promote")
        rows.append({**row(name, summary), "total_seconds": round(time.monotonic() - started, 1)})
        print(table(rows), flush=True)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    atomic_write_json(Path(args.out), {"overrides": args.overrides, "uptime": load, "rows": rows})
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
