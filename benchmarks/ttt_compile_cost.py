"""CPU seconds of the first training steps of the TTT objective in a fresh process, per attention path.

What the fused path's inductor compile adds to every training process (the tests train many short runs, each worker
its own process): one process, a test-size drafter (tests/drafter_helpers.tiny_drafter), B=4, 7 TTT steps, soft loss,
activation checkpointing, a forward+backward and a no-grad forward (validation) per row length given, one thread.
Run it under `time` to count the compile's subprocesses too, with TORCHINDUCTOR_CACHE_DIR set to an empty directory
(cold cache: a clean CI machine) and then again to the same one (warm: every later process):

    TORCHINDUCTOR_CACHE_DIR=/tmp/ic time python benchmarks/ttt_compile_cost.py fused packed 40,64,90,130,200,256
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("platform", "tests")]
from drafter_helpers import random_inputs, tiny_drafter  # noqa: E402

from draftline.drafter.ttt import ttt_loss  # noqa: E402

BATCH = 4


def step(model, length: int, attention: str, packed: bool) -> None:
    embeds, aux, target_logits = random_inputs(model.config, BATCH, length)
    logits, target_ids = target_logits[..., model.t2d], target_logits.argmax(-1)
    documents = None
    if packed:  # two samples a row
        documents = torch.zeros(BATCH, length, dtype=torch.long)
        documents[:, length // 2 :] = 1
    options = dict(target_ids=target_ids, document_ids=documents, steps=7, decay=0.8, loss="soft",
                   attention=attention, checkpointed=True)  # fmt: skip
    loss, _ = ttt_loss(model, embeds, aux, logits, torch.ones(BATCH, length), **options)
    loss.backward()
    with torch.no_grad():
        ttt_loss(model, embeds, aux, logits, torch.ones(BATCH, length), **options)


def main() -> int:
    attention, layout, lengths = sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3].split(",")]
    torch.set_num_threads(1)
    model = tiny_drafter()
    report = {"attention": attention, "layout": layout}
    for length in lengths:
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        step(model, length, attention, layout == "packed")
        report[f"L{length}"] = {"cpu_s": round(time.process_time() - cpu_started, 2),
                                "wall_s": round(time.perf_counter() - wall_started, 2)}  # fmt: skip
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
