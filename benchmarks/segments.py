"""Accept length per prompt segment (has-tools / thinking-on / thinking-off / plain): qwen3 twin and real target.

    .venv/bin/python benchmarks/segments.py twin                 # the qwen3 twin, three drafters, two prompt sets
    .venv/bin/python benchmarks/segments.py real --drafter DIR --dataset DIR --target DIR  # its bench split

twin: the qwen3 shape twin (configs/twins/qwen3-8b.yaml) built with Qwen3's chat layout (`target.embedded.chat_template
=qwen3`: tool schemas and the `enable_thinking` switch; the twin config itself keeps draftline's layout). Its own
conversations, plus `--tool-conversations` seeded tool conversations in OpenAI form (tools declared, an assistant
call, the tool's result, a reply), are the pipeline's `data.conversations`; `regenerate` rewrites every assistant
turn with the twin (keeping a recorded call and its result only where the twin writes that call itself). Three
drafters, each `run_pipeline` bootstrap -> gate in one data dir (the twin is built once):
  mixed    data.thinking=mixed (each conversation on or off by a hash of its id)
  off      data.thinking=off
  default  data.thinking unset (the template's default; its prompts are the `plain` segment)
then every drafter is benched side by side on two prompt sets, in one `run_bench` each: the bench split of the mixed
run (has-tools, thinking-on, thinking-off) and of the default run (has-tools, plain). Each cell is accept length
(output tokens / verify steps, greedy) over that segment's prompts.

real: the per-segment split of a trained real-target drafter's bench on the bench split of the dataset it was
trained from (target.kind=hf on the imported directory; nothing is prepared, regenerated or trained again).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "platform"))

from draftline.bench.prompts import SEGMENTS  # noqa: E402
from draftline.bench.run import run_bench  # noqa: E402
from draftline.config import DraftlineConfig, load_config  # noqa: E402
from draftline.utils import atomic_write_json, stable_hash  # noqa: E402

TWIN = REPO / "configs" / "twins" / "qwen3-8b.yaml"
REAL = REPO / "configs" / "smollm2-135m-cpu.yaml"
# drafter label -> data.thinking it is trained with (None: the template's default)
TWIN_RUNS = {"mixed": "mixed", "off": "off", "default": None}
TWIN_SETTINGS = [
    "target.embedded.chat_template=qwen3",
    "target.embedded.train_steps=160",  # of the config's 400 (16 x 128 tokens each): fits this shared machine
    "train.max_steps=150",
    "regenerate.enabled=true",
    "regenerate.max_new_tokens_per_turn=64",  # as long as the twin's own replies (target.embedded.reply_max_new_tokens)
    "data.max_seq_len=448",  # a tool prompt: 240-270 twin tokens (Qwen3's tool preamble); 448 + 48 new < 512 positions
    "data.split.bench_fraction=0.2",  # ~60 bench prompts: ~20 per segment
    "bench.num_prompts=80",
    "gate.max_rounds=3",  # accept length is what is measured here (greedy: the same in every round), not a timing
]
# Modules whose public functions the tool conversations ask about: the stdlib text the twin was trained on.
MODULES = ["os.path", "json", "re", "math", "itertools", "functools", "collections", "string", "textwrap", "shutil",
           "random", "statistics", "heapq", "bisect", "fnmatch", "glob", "base64", "zlib", "difflib", "calendar"]


def _log(msg: str) -> None:
    print(f"[segments] {msg}", flush=True)


def _schema(name: str, description: str, parameter: str) -> dict:
    # one short parameter: Qwen3's tool preamble alone is ~150 twin tokens, and the twin holds 512 positions
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {parameter: {"type": "string"}}, "required": [parameter]}}}


TOOLS = [_schema("lookup_docs", "Docstring of a function.", "name"),
         _schema("run_python", "Run Python code.", "code"),
         _schema("search_stdlib", "Search the stdlib.", "query")]


def _functions() -> list[tuple[str, str, str]]:
    """(module, function, first docstring line) of every public function of MODULES, in a stable order."""
    found = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, value in sorted(vars(module).items()):
            doc = inspect.getdoc(value) if callable(value) and not name.startswith("_") else None
            if doc and not inspect.isclass(value):
                found.append((module_name, name, doc.splitlines()[0]))
    return found


def tool_conversation(rng: random.Random, index: int, functions: list[tuple[str, str, str]]) -> dict:
    """One seeded tool conversation in OpenAI form: the user asks about a stdlib function, the assistant calls a tool,
    the tool answers (real docstring text), the assistant replies."""
    module, name, doc = rng.choice(functions)
    kind = rng.randrange(3)
    if kind == 0:
        ask, call, result = (f"What does {module}.{name} do? Look it up.",
                             ("lookup_docs", {"name": f"{module}.{name}"}), doc)  # fmt: skip
    elif kind == 1:
        ask, call, result = (f"Show me what {module}.{name} is by running it.",
                             ("run_python", {"code": f"import {module.split('.')[0]}\nprint({module}.{name})"}),
                             f"<function {module}.{name}>")  # fmt: skip
    else:
        ask, call, result = (f"Which function in {module} would I use for this: {doc.lower()}",
                             ("search_stdlib", {"query": doc}), f"{module}.{name}")  # fmt: skip
    declared = [t for t in TOOLS if t["function"]["name"] == call[0]]  # one schema: the twin holds 512 positions
    call_id = f"call_{index}"
    return {"id": f"tool-{index:05d}", "tools": declared, "messages": [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": call[0], "arguments": json.dumps(call[1])}}]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
        {"role": "assistant", "content": f"{module}.{name}: {doc}"}]}  # fmt: skip


def mixed_conversations(target_dir: Path, count: int, seed: int, out_dir: Path) -> Path:
    """The twin's own conversations followed by `count` seeded tool conversations, as one jsonl (cached by content)."""
    own = (target_dir / "conversations.jsonl").read_text()
    rng = random.Random(seed)
    functions = _functions()
    tools = "".join(json.dumps(tool_conversation(rng, i, functions)) + "\n" for i in range(count))
    path = out_dir / f"conversations-{stable_hash(own, tools)[:16]}.jsonl"
    if not path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(own + tools)
    return path


def twin_config(data_dir: Path, label: str, thinking, conversations: Path | None,
                overrides: list[str]) -> DraftlineConfig:
    extra = [f"data.thinking={thinking}"] if thinking else []
    extra += [f"data.conversations={conversations}"] if conversations else []
    return load_config(TWIN, [f"data_dir={data_dir}", f"name=twin-qwen3-8b-{label}", *TWIN_SETTINGS, *extra,
                              *overrides])


def segment_cells(rows: list[dict], label: str) -> dict:
    """label's row at the lowest concurrency -> {"accept_length", "segments": {segment: {accept_length, prompts}}}."""
    row = min((r for r in rows if r["label"] == label), key=lambda r: r["concurrency"])
    return {"accept_length": row["accept_length"], "segments": row.get("accept_length_by_segment") or {}}


def _regenerated(regenerated_dir: Path) -> dict:
    """What regenerate did to the conversations: how many, and how many it cut at a tool call the twin did not make."""
    manifest = json.loads((regenerated_dir / "manifest.json").read_text())
    return {k: manifest.get(k) for k in ("conversations", "output_tokens", "stopped_at_tool_call")}


def twin(args: argparse.Namespace, save) -> dict:
    from draftline.pipeline import run_pipeline
    from draftline.raycluster import ensure_ray
    from draftline.target.bootstrap import bootstrap_target

    data_dir = Path(args.data_dir)
    started = time.monotonic()
    target_dir = bootstrap_target(twin_config(data_dir, "bootstrap", None, None, args.overrides))
    conversations = mixed_conversations(target_dir, args.tool_conversations, 0, data_dir / "segments")
    _log(f"twin {target_dir}; conversations {conversations}")
    result = {"target_dir": str(target_dir), "conversations": str(conversations), "runs": {}, "benches": {}}
    runs = result["runs"]
    for label in args.runs:
        thinking = TWIN_RUNS[label]
        ensure_ray(num_cpus=4)  # Ray Train's controller besides 2 workers, on a 2-core machine (as the tests do)
        cfg = twin_config(data_dir, label, thinking, conversations, args.overrides)
        summary = run_pipeline(cfg, until="gate")  # resumes: a stage done with the same inputs is skipped
        gate = summary["gate"]["outputs"]
        regenerated = summary["regenerate"]["outputs"]
        runs[label] = {"thinking": thinking, "export_dir": str(summary["train"]["outputs"]["export_dir"]),
                       "val_est_accept_len": summary["train"]["outputs"]["metrics"]["val_est_accept_len"],
                       "gate": {"verdict": gate["verdict"], "accept_length": gate["bench"]["accept_length"],
                                "segments": segment_cells(gate["bench"]["rows"], f"v{gate['version']}")},
                       "regenerated": _regenerated(Path(regenerated["conversations"]).parent),
                       "dataset": summary["prepare"]["outputs"]["report"],
                       "seconds": {s: round(v["seconds"], 1) for s, v in summary.items() if "seconds" in v}}  # fmt: skip
        _log(f"{label}: {json.dumps(runs[label])}")
        save(result)
    candidates = [(label, Path(run["export_dir"]), None) for label, run in runs.items()]
    for prompts in [p for p in ("mixed", "default") if p in runs]:
        ensure_ray(num_cpus=4)
        cfg = twin_config(data_dir, prompts, TWIN_RUNS[prompts], conversations, args.overrides)
        report = run_bench(cfg, candidates)
        result["benches"][prompts] = {label: segment_cells(report["rows"], label) for label in runs}
        _log(f"bench on {prompts} prompts: {json.dumps(result['benches'][prompts])}")
        save(result)
    return {**result, "seconds": round(time.monotonic() - started, 1)}


def real(args: argparse.Namespace) -> dict:
    cfg = load_config(REAL, [f"data_dir={args.data_dir}", "target.kind=hf", f"target.path={args.target}",
                             *args.overrides])  # fmt: skip
    report = run_bench(cfg, [("drafter", Path(args.drafter), None)], dataset_dir=Path(args.dataset))
    return {"drafter": args.drafter, "dataset": args.dataset, "cells": segment_cells(report["rows"], "drafter"),
            "rows": [{k: v for k, v in r.items() if k != "per_request_accept_lengths"} for r in report["rows"]]}


def table(benches: dict) -> str:
    """One line per (prompt set, drafter): overall accept length, then each segment's (prompts)."""
    head = ["prompts", "drafter trained", "overall", *SEGMENTS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for prompts, by_drafter in benches.items():
        for label, cells in by_drafter.items():
            seg = cells["segments"]
            lines.append("| " + " | ".join([prompts, label, f"{cells['accept_length']:.3f}", *(
                f"{seg[s]['accept_length']:.3f} ({seg[s]['prompts']})" if s in seg and seg[s]["accept_length"] is not None
                else "-" for s in SEGMENTS)]) + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    twin_args = sub.add_parser("twin")
    twin_args.add_argument("--data-dir", default="/tmp/draftline-segments")
    twin_args.add_argument("--tool-conversations", type=int, default=100)
    twin_args.add_argument("--runs", nargs="+", default=list(TWIN_RUNS), choices=list(TWIN_RUNS),
                           help="which drafters to train (the rest of the run is skipped: a partial result is kept)")
    twin_args.add_argument("--out", default=str(REPO / "benchmarks" / "segments-twin.json"))
    real_args = sub.add_parser("real")
    real_args.add_argument("--data-dir", default="/tmp/draftline-segments-real")
    real_args.add_argument("--drafter", required=True, help="the drafter's export directory")
    real_args.add_argument("--dataset", required=True, help="the prepared dataset it was trained from (bench split)")
    real_args.add_argument("--target", required=True, help="the imported target's HF directory")
    real_args.add_argument("--out", default=str(REPO / "benchmarks" / "segments-real.json"))
    for p in (twin_args, real_args):
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    def save(result: dict) -> None:
        """The result so far, with the load average now (a twin run writes after each drafter and each bench)."""
        load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        atomic_write_json(Path(args.out), {"overrides": args.overrides, "uptime": load, **result})

    result = twin(args, save) if args.what == "twin" else real(args)
    save(result)
    print(table(result["benches"] if args.what == "twin" else {"bench split": {"drafter": result["cells"]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
