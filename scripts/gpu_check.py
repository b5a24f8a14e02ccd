"""draftline's own CUDA paths on a GPU machine, without Ray, DeepSpeed, MLflow or SGLang.

    PYTHONPATH=platform:tests python scripts/gpu_check.py DATA_DIR OUT_JSON

DATA_DIR holds the test target, its prepared dataset and the fitted drafter as the tests cache them
(`targets/`, `datasets/`, `quick-drafters/` of .draftline-test). The machine needs torch with CUDA, transformers,
pydantic, pyyaml and numpy only, so it runs where the serving stack cannot be installed (scripts/gpu_smoke.sh runs it
first). Three checks, each on CPU and CUDA on the same machine, side by side:

1. the reference engine (`engine.device`), chain and tree drafts, through `run_bench`: EAGLE-3 greedy must be
   token-identical to the target alone on each device, and the accept lengths are compared across devices;
2. the training objective exactly as the training worker builds it (`objective_for`: the config's TTT attention,
   `batch_maker`: its packing, `objective_inputs`, `TargetHead`, `build_drafter`) on inputs captured from the
   target: the same seeded steps on CPU fp32, CUDA fp32, and the step-0 loss and gradient in bf16 (as DeepSpeed's
   bf16 engine runs the forward);
3. the export of drafter weights that live on the GPU, loaded back on CPU (the path a GPU-trained drafter takes);
4. where DeepSpeed imports: the same steps through `deepspeed.initialize` with the production config's precision and
   ZeRO stage (configs/llama3.1-8b-4xgpu.yaml: bf16, ZeRO-2; one rank, nccl on CUDA), against the fp32 run, then the
   worker's checkpoint of the drafter (`save_drafter_weights`) exported and loaded back.

Prints one line per figure and PASS or FAIL (with the reasons) as its last line; writes every figure to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import os

import torch

from conftest import make_test_config

# The device checked against CPU; "cpu" runs every step of this script on a machine without a GPU (a dry run).
GPU = os.environ.get("DRAFTLINE_GPU_CHECK_DEVICE", "cuda")

TRAIN_STEPS = 60
TRAIN_SAMPLES = 64
PRODUCTION_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "llama3.1-8b-4xgpu.yaml"


def bench(data_dir: str, drafter_dir: Path, device: str, extra: list[str], temperature: float) -> dict:
    from draftline.bench.run import run_bench

    overrides = [*extra, f"engine.device={device}", "bench.concurrency=[1,4]", "bench.rounds=2"]
    cfg = make_test_config(data_dir, overrides)
    return run_bench(cfg, [("eagle3", drafter_dir, None)], temperature=temperature, log=lambda *_: None)


def engine_check(data_dir: str, drafter_dir: Path, problems: list[str]) -> dict:
    """Reference engine on CPU and CUDA, chain and tree: greedy lossless on each device, accept lengths side by side;
    sampled chains (temperature 0.8: rejection sampling, per-request generators) run on each device too."""
    tree = ["engine.speculative.eagle_topk=4", "engine.speculative.num_draft_tokens=8"]
    shapes = {"chain": ([], 0.0), "tree": (tree, 0.0), "sampled": ([], 0.8)}
    out: dict = {}
    for shape, (extra, temperature) in shapes.items():
        for device in ("cpu", GPU):
            started = time.perf_counter()
            report = bench(data_dir, drafter_dir, device, extra, temperature)
            rows = {(r["label"], r["concurrency"]): r for r in report["rows"]}
            out[f"{shape}/{device}"] = {"seconds": round(time.perf_counter() - started, 1), "rows": report["rows"]}
            for concurrency in report["concurrency"]:
                eagle, base = rows[("eagle3", concurrency)], rows[("target-only", concurrency)]
                print(f"[gpu-check] engine {shape:5s} {device:4s} c={concurrency}: accept {eagle['accept_length']:.3f}"
                      f" lossless {eagle['lossless']} tok/s {base['output_tokens_per_s']:.1f} ->"
                      f" {eagle['output_tokens_per_s']:.1f} speedup {eagle['speedup']}", flush=True)
                if temperature == 0 and eagle["lossless"] is not True:
                    problems.append(f"engine {shape} on {device} at c={concurrency}: EAGLE-3 not token-identical")
                if not eagle["accept_length"] > 1:
                    problems.append(f"engine {shape} on {device} c={concurrency}: accept {eagle['accept_length']}")
        cpu_accept = [r["accept_length"] for r in out[f"{shape}/cpu"]["rows"] if r["label"] == "eagle3"]
        gpu_accept = [r["accept_length"] for r in out[f"{shape}/{GPU}"]["rows"] if r["label"] == "eagle3"]
        out[f"{shape}/accept_cpu_vs_cuda"] = [cpu_accept, gpu_accept]
    return out


def captured_samples(cfg, target_dir: Path, dataset_dir: Path) -> tuple:
    """Train-split samples with the target's aux and final hidden states, as extraction stores them."""
    from draftline.data.prepare import load_split
    from draftline.target.aux_layers import family_of
    from draftline.target.capture import capture_aux_hidden
    from draftline.target.load import load_target, resolve_aux_layer_ids

    target = load_target(cfg, device=GPU, target_dir=target_dir)
    aux_ids = resolve_aux_layer_ids(cfg, target.num_layers, family_of(target.model.config))
    samples = []
    with torch.no_grad():
        for sample in load_split(dataset_dir, "train")[:TRAIN_SAMPLES]:
            ids = torch.tensor([sample["input_ids"]], device=GPU)
            aux, final = capture_aux_hidden(target.model, ids, None, aux_ids)
            samples.append({"input_ids": ids[0].cpu(), "loss_mask": torch.tensor(sample["loss_mask"]),
                            "aux_hidden": aux[0].float().cpu(), "final_hidden": final[0].float().cpu()})
    return samples, aux_ids, target.model.config


def objective_run(cfg, samples, head_cpu, d2t, t2d, drafter_config, device: str, dtype, steps: int,
                  deepspeed_train=None) -> dict:
    """`steps` seeded AdamW steps (constant lr) of the training worker's objective; with `deepspeed_train` (a
    TrainConfig) through DeepSpeed's engine with that config's precision and ZeRO stage, as the worker runs it."""
    from draftline.train.loop import batch_maker, build_drafter, deepspeed_config, objective_for, objective_inputs

    torch.manual_seed(cfg.seed)
    head = head_cpu.to(device, dtype)
    drafter = build_drafter(drafter_config, head_cpu, d2t, t2d)
    drafter = drafter.to(device) if deepspeed_train else drafter.to(device, dtype)  # DeepSpeed casts it itself
    train = cfg.train
    objective = objective_for(drafter, train)
    make_batch = batch_maker(train)
    optimizer = torch.optim.AdamW(objective.parameters(), lr=train.lr, betas=(0.9, 0.95))
    engine = None
    if deepspeed_train is not None:
        import deepspeed

        engine, optimizer, _, _ = deepspeed.initialize(
            model=objective, optimizer=optimizer, config=deepspeed_config(deepspeed_train)
        )
    losses, grad_norm, step_s = [], None, []
    generator = torch.Generator().manual_seed(cfg.seed)
    for step in range(steps):
        indices = torch.randint(len(samples), (train.micro_batch_size,), generator=generator).tolist()
        batch = make_batch([samples[i] for i in indices]).to(device, dtype)
        started = time.perf_counter()
        if engine is not None:
            loss, metrics = engine(*objective_inputs(batch, head, t2d.to(device), dtype))
            engine.backward(loss)
            engine.step()
            first_grads = None
        else:
            loss, metrics = objective(*objective_inputs(batch, head, t2d.to(device), dtype))
            optimizer.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(objective.parameters(), train.grad_clip)
            if step == 0:
                grad_norm = float(norm)
                grads = [p.grad.float().flatten().cpu() for p in objective.parameters() if p.grad is not None]
                first_grads = torch.cat(grads)
            optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - started)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norm_0": grad_norm, "first_grads": first_grads, "drafter": drafter,
            "engine": engine,
            "median_step_ms": round(1000 * sorted(step_s)[len(step_s) // 2], 2), "acc_0_last": metrics["acc_0"]}


def training_check(cfg, target_dir: Path, dataset_dir: Path, problems: list[str]) -> tuple[dict, object]:
    from draftline.data.prepare import load_vocab
    from draftline.drafter.model import DrafterConfig
    from draftline.train.data import load_target_head

    samples, aux_ids, hf_config = captured_samples(cfg, target_dir, dataset_dir)
    d2t, t2d = load_vocab(dataset_dir)
    drafter_config = DrafterConfig.from_target(hf_config, int(d2t.shape[0]), aux_ids)
    head = load_target_head(target_dir)
    runs = {
        "cpu_fp32": objective_run(cfg, samples, head, d2t, t2d, drafter_config, "cpu", torch.float32, TRAIN_STEPS),
        "cuda_fp32": objective_run(cfg, samples, head, d2t, t2d, drafter_config, GPU, torch.float32, TRAIN_STEPS),
        "cuda_bf16": objective_run(cfg, samples, head, d2t, t2d, drafter_config, GPU, torch.bfloat16, 1),
    }
    cpu, gpu, bf16 = runs["cpu_fp32"], runs["cuda_fp32"], runs["cuda_bf16"]
    cos = torch.nn.functional.cosine_similarity
    figures = {
        "steps": TRAIN_STEPS,
        "loss_0": {name: run["losses"][0] for name, run in runs.items()},
        "loss_last": {name: run["losses"][-1] for name, run in runs.items() if len(run["losses"]) > 1},
        "grad_norm_0": {name: run["grad_norm_0"] for name, run in runs.items()},
        "grad_cosine_0_cuda_fp32_vs_cpu": float(cos(cpu["first_grads"], gpu["first_grads"], dim=0)),
        "grad_cosine_0_cuda_bf16_vs_fp32": float(cos(gpu["first_grads"], bf16["first_grads"], dim=0)),
        "max_loss_gap_cuda_vs_cpu": max(abs(a - b) / abs(b) for a, b in zip(gpu["losses"], cpu["losses"])),
        "median_step_ms": {name: run["median_step_ms"] for name, run in runs.items()},
        "acc_0_last": {name: run["acc_0_last"] for name, run in runs.items()},
    }
    for key, value in figures.items():
        print(f"[gpu-check] train {key}: {value}", flush=True)
    if abs(gpu["losses"][0] - cpu["losses"][0]) / cpu["losses"][0] > 1e-4:
        problems.append(f"train: step-0 loss CUDA fp32 {gpu['losses'][0]} vs CPU {cpu['losses'][0]}")
    if figures["grad_cosine_0_cuda_fp32_vs_cpu"] < 0.9999:
        problems.append(f"train: step-0 gradients CUDA vs CPU cosine {figures['grad_cosine_0_cuda_fp32_vs_cpu']}")
    if figures["grad_cosine_0_cuda_bf16_vs_fp32"] < 0.99 or abs(bf16["losses"][0] / gpu["losses"][0] - 1) > 0.02:
        problems.append(f"train: bf16 step 0 off fp32 (loss {bf16['losses'][0]} vs {gpu['losses'][0]}, "
                        f"cosine {figures['grad_cosine_0_cuda_bf16_vs_fp32']})")
    if not gpu["losses"][-1] < 0.8 * gpu["losses"][0]:
        problems.append(f"train: CUDA loss did not fall ({gpu['losses'][0]} -> {gpu['losses'][-1]})")
    try:
        figures["deepspeed"] = deepspeed_check(cfg, samples, head, d2t, t2d, drafter_config, gpu["losses"], problems)
    except Exception as error:
        import traceback

        traceback.print_exc()
        problems.append(f"deepspeed: {type(error).__name__}: {error}")
    return figures, gpu["drafter"]


def deepspeed_check(cfg, samples, head, d2t, t2d, drafter_config, fp32_losses: list[float], problems: list[str]):
    """The production config's DeepSpeed precision and ZeRO stage on one rank, against the fp32 run; then the
    worker's drafter checkpoint, exported and loaded back."""
    try:
        import deepspeed
    except ImportError as error:
        print(f"[gpu-check] deepspeed not run: {error}", flush=True)
        return {"not_run": str(error)}
    from draftline.config import load_config
    from draftline.drafter.export import export_from_checkpoint, load_drafter
    from draftline.train.loop import save_drafter_weights
    from draftline.utils import free_port

    production = load_config(PRODUCTION_CONFIG).train
    train = cfg.train.model_copy(update={"dtype": production.dtype, "zero_stage": production.zero_stage})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="nccl" if GPU == "cuda" else "gloo")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[train.dtype]
    run = objective_run(cfg, samples, head, d2t, t2d, drafter_config, GPU, dtype, TRAIN_STEPS, deepspeed_train=train)
    losses = run["losses"]
    figures = {
        "deepspeed": deepspeed.__version__, "dtype": train.dtype, "zero_stage": train.zero_stage,
        "loss_0": losses[0], "loss_last": losses[-1], "fp32_loss_last": fp32_losses[-1],
        "max_loss_gap_vs_fp32": max(abs(a - b) / abs(b) for a, b in zip(losses, fp32_losses)),
        "median_step_ms": run["median_step_ms"],
    }
    with tempfile.TemporaryDirectory() as tmp:
        save_drafter_weights(run["engine"], Path(tmp) / "ckpt", rank=0, zero_stage=train.zero_stage)
        export_from_checkpoint(Path(tmp) / "ckpt", Path(tmp) / "export")
        loaded = load_drafter(Path(tmp) / "export", device=GPU)
        hidden = torch.randn(2, 5, drafter_config.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            live = run["engine"].module.drafter.logits(hidden.to(GPU, dtype)).float()
            figures["export_logit_gap"] = float((loaded.logits(hidden.to(GPU, loaded.fc.weight.dtype)).float() - live)
                                                .abs().max())
        figures["export_dtype"] = str(loaded.fc.weight.dtype)
    print(f"[gpu-check] train deepspeed: {figures}", flush=True)
    if abs(losses[0] / fp32_losses[0] - 1) > 0.02 or not losses[-1] < 0.8 * losses[0]:
        problems.append(f"deepspeed {train.dtype} ZeRO-{train.zero_stage}: loss {losses[0]} -> {losses[-1]} "
                        f"(fp32: {fp32_losses[0]} -> {fp32_losses[-1]})")
    if abs(losses[-1] / fp32_losses[-1] - 1) > 0.05:
        problems.append(f"deepspeed {train.dtype}: final loss {losses[-1]} vs fp32 {fp32_losses[-1]}")
    if figures["export_logit_gap"] > 1e-2:
        problems.append(f"deepspeed: exported checkpoint's logits differ by {figures['export_logit_gap']}")
    torch.distributed.destroy_process_group()
    return figures


def export_check(drafter, problems: list[str]) -> dict:
    """Export weights that live on the GPU; load the export on CPU; same logits."""
    from draftline.drafter.export import export_drafter, load_drafter

    drafter = drafter.eval()
    with tempfile.TemporaryDirectory() as tmp:
        export_drafter(drafter, Path(tmp) / "export", meta={"gpu_check": True})
        loaded = load_drafter(Path(tmp) / "export", device="cpu")
    hidden = torch.randn(2, 5, drafter.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = float((loaded.logits(hidden) - drafter.logits(hidden.to(GPU)).cpu()).abs().max())
    print(f"[gpu-check] export from CUDA weights, loaded on CPU: max logit gap {gap:.2e}", flush=True)
    if gap > 1e-4:
        problems.append(f"export: logits of the CPU-loaded export differ by {gap}")
    return {"max_logit_gap": gap}


def main(data_dir: str, out_json: str) -> int:
    from draftline.bench.quick_drafter import quick_drafter
    from draftline.data.prepare import prepare
    from draftline.target.load import resolve_target_dir

    if GPU == "cuda" and not torch.cuda.is_available():
        print("FAIL: torch sees no CUDA device")
        return 1
    cfg = make_test_config(data_dir)
    target_dir = resolve_target_dir(cfg)
    dataset_dir = prepare(cfg, target_dir)
    drafter_dir = quick_drafter(cfg, target_dir, dataset_dir, steps=200)
    device_name = torch.cuda.get_device_name() if GPU == "cuda" else GPU
    print(f"[gpu-check] {device_name}, torch {torch.__version__}, target {target_dir.name}, "
          f"drafter {drafter_dir.name}", flush=True)
    problems: list[str] = []
    figures = {"device": device_name, "torch": torch.__version__}
    for name, check in (("engine", lambda: engine_check(data_dir, drafter_dir, problems)),
                        ("train", lambda: training_check(cfg, target_dir, dataset_dir, problems))):
        try:
            figures[name] = check()
        except Exception as error:  # a crash on CUDA is the finding: record it and go on to the next check
            import traceback

            traceback.print_exc()
            problems.append(f"{name}: {type(error).__name__}: {error}")
    if isinstance(figures.get("train"), tuple):
        figures["train"], drafter = figures["train"]
        try:
            figures["export"] = export_check(drafter, problems)
        except Exception as error:
            problems.append(f"export: {type(error).__name__}: {error}")
    Path(out_json).write_text(json.dumps({"problems": problems, **figures}, indent=1, default=str) + "\n")
    if problems:
        print("FAIL: " + "; ".join(problems))
        return 1
    print("PASS: reference engine lossless on CUDA (chain and tree; sampled chains run), training objective on CUDA "
          "equals CPU (and through DeepSpeed where it imports), GPU export loads on CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
