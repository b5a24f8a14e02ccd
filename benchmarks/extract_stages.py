"""Pipelined capture (draftline.target.stages) vs single-process capture, side by side in one run (issue 15).

    nice -n -15 python benchmarks/extract_stages.py [--hidden-sizes 96 512] [--stages 2 4] [--rounds 3]

For each width: a random-weight Llama of the test target's shape (8 layers; tests/conftest.py) at that hidden size.
Round by round, in rotating order over the same micro-batches: the whole model in this process
(`capture_aux_hidden` batch by batch, with 1 and with all the machine's cores as torch threads) and each pipeline
(`PipelinedTarget.capture_many`, one stage actor per `cpus_per_stage` CPU, several micro-batches in flight).
Stage start-up (actor processes, loading) is excluded: extraction pays it once per worker. Prints JSON with
tokens/s per mode and round, the best of each against the best single-process run, and the load average
before and after. On a loaded shared machine several processes get more of the CPUs than one: compare on an idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from draftline.config import PipelineConfig  # noqa: E402
from draftline.extract.worker import right_padded_batch  # noqa: E402
from draftline.raycluster import ensure_ray  # noqa: E402
from draftline.target.capture import capture_aux_hidden  # noqa: E402
from draftline.target.stages import PipelinedTarget  # noqa: E402

AUX_LAYER_IDS = [1, 3, 6]


def random_llama(hidden_size: int, out_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from conftest import make_test_config
    from draftline.target.families import build_model_config

    emb = make_test_config().target.embedded.model_copy(
        update={"family": "llama", "hidden_size": hidden_size, "intermediate_size": hidden_size * 8 // 3}
    )
    config = build_model_config(emb, {"vocab_size": 1024, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


def batches_of(count: int, batch_size: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 1024, (seq_len,), generator=generator) for _ in range(count * batch_size)]
    return [right_padded_batch(sequences[i : i + batch_size], pad_id=0) for i in range(0, len(sequences), batch_size)]


def timed_tokens_per_s(run, batches) -> float:
    started = time.perf_counter()
    results = run(batches)
    elapsed = time.perf_counter() - started
    assert len(results) == len(batches)
    return sum(int(mask.sum()) for _, mask in batches) / elapsed


def single_process(model, batches, threads: int) -> list:
    torch.set_num_threads(threads)
    return [capture_aux_hidden(model, ids, mask, AUX_LAYER_IDS) for ids, mask in batches]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden-sizes", type=int, nargs="+", default=[96, 512])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cpus-per-stage", type=float, default=1.0)
    parser.add_argument("--micro-batches", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single-threads", type=int, nargs="+", default=[1, os.cpu_count()],
                        help="torch threads of the single-process runs")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    load_before = os.getloadavg()
    ensure_ray(num_cpus=int(sum(args.stages) * args.cpus_per_stage) + 1)
    batches = batches_of(args.micro_batches, args.batch_size, args.seq_len)
    report = {"load_before": load_before, "batches": f"{args.micro_batches} x {args.batch_size} x {args.seq_len} tokens",
              "cpus_per_stage": args.cpus_per_stage, "widths": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        for hidden_size in args.hidden_sizes:
            target_dir = random_llama(hidden_size, Path(scratch) / f"h{hidden_size}")
            model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
            pipelines = {
                stages: PipelinedTarget(target_dir, AUX_LAYER_IDS, PipelineConfig(stages=stages, cpus_per_stage=args.cpus_per_stage), "float32")
                for stages in args.stages
            }  # fmt: skip
            modes = {
                f"{stages} stages": (lambda b, p=pipeline: list(p.capture_many(b)))
                for stages, pipeline in pipelines.items()
            }
            for threads in args.single_threads:
                modes[f"single process, {threads} thread(s)"] = lambda b, t=threads: single_process(model, b, t)
            for run in modes.values():  # warm-up: first calls pay allocation and lazy initialisation
                run(batches[:2])
            samples: dict[str, list[float]] = {name: [] for name in modes}
            names = list(modes)
            for round_index in range(args.rounds):
                for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                    samples[name].append(timed_tokens_per_s(modes[name], batches))
            best = {name: max(values) for name, values in samples.items()}
            single = max((name for name in names if name.startswith("single")), key=best.get)
            report["widths"][hidden_size] = {
                "tokens_per_s": {name: [round(v, 1) for v in values] for name, values in samples.items()},
                f"best_vs_best_single_process ({single})": {name: round(best[name] / best[single], 3) for name in names},
            }
            for pipeline in pipelines.values():
                pipeline.shutdown()
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
