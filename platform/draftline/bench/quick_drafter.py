"""Fit a small EAGLE-3 drafter in-process, for engine tests and benchmarks that need a drafter that accepts.

This is not the training stage (`draftline train`: Ray Train, DeepSpeed, checkpoints, MLflow). It runs the same
maths (`capture_aux_hidden` for the inputs, `ttt_loss` for the objective) on one process, for a few hundred steps
on the prepared train split, and exports the result; the output is cached by its inputs.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from draftline.config import DraftlineConfig
from draftline.data.prepare import load_split, load_vocab
from draftline.drafter.export import META_FILE, export_drafter
from draftline.drafter.model import DrafterConfig, Eagle3Drafter
from draftline.drafter.ttt import target_signals, ttt_loss
from draftline.drafter.ttt_attention import AttentionKind
from draftline.target.aux_layers import family_of
from draftline.target.capture import capture_aux_hidden, drafter_token_embedding
from draftline.target.load import load_target, resolve_aux_layer_ids
from draftline.utils import atomic_write_json, build_lock, stable_hash


def ttt_loss_on_samples(model, drafter, batch: list[dict], aux_layer_ids: list[int], ttt_steps: int,
                        attention: AttentionKind = "fused"):
    """The TTT objective on prepared samples (right-padded), target signals computed on the fly -> (loss, metrics)."""
    length = max(len(s["input_ids"]) for s in batch)
    input_ids = torch.zeros(len(batch), length, dtype=torch.long)
    attention_mask = torch.zeros(len(batch), length, dtype=torch.long)
    loss_mask = torch.zeros(len(batch), length, dtype=torch.long)
    for row, sample in enumerate(batch):
        n = len(sample["input_ids"])
        input_ids[row, :n] = torch.tensor(sample["input_ids"])
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample["loss_mask"])
    with torch.no_grad():
        aux_hidden, final_hidden = capture_aux_hidden(model, input_ids, attention_mask, aux_layer_ids)
        logits_draft, target_ids = target_signals(model.lm_head(final_hidden), drafter.t2d)
        input_embeds = drafter_token_embedding(model)(input_ids)
    return ttt_loss(drafter, input_embeds, aux_hidden, logits_draft, loss_mask,
                    target_ids=target_ids, attention_mask=attention_mask, steps=ttt_steps, attention=attention)


def quick_drafter(
    cfg: DraftlineConfig,
    target_dir: str | Path,
    dataset_dir: str | Path,
    steps: int = 300,
    batch_size: int = 8,
    lr: float = 3e-3,
    ttt_steps: int = 4,
    seed: int = 0,
) -> Path:
    """-> export dir `<data_dir>/quick-drafters/<hash>/` (reused when it exists)."""
    target = load_target(cfg, target_dir=target_dir)
    key = stable_hash(target.fingerprint, str(Path(dataset_dir).name), steps, batch_size, lr, ttt_steps, seed)[:16]
    out_dir = cfg.data_path("quick-drafters", key)
    with build_lock(out_dir):
        if (out_dir / META_FILE).exists():
            return out_dir
        return _fit(cfg, target, dataset_dir, out_dir, steps, batch_size, lr, ttt_steps, seed)


def _fit(cfg: DraftlineConfig, target, dataset_dir: str | Path, out_dir: Path, steps: int, batch_size: int, lr: float,
         ttt_steps: int, seed: int) -> Path:
    torch.manual_seed(seed)
    model = target.model
    aux_layer_ids = resolve_aux_layer_ids(cfg, target.num_layers, family_of(model.config))
    d2t, t2d = load_vocab(dataset_dir)
    config = DrafterConfig.from_target(model.config, int(d2t.shape[0]), aux_layer_ids)
    drafter = Eagle3Drafter(config)
    drafter.set_vocab(d2t, t2d)
    samples = load_split(dataset_dir, "train")
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    started = time.perf_counter()
    metrics: dict[str, float] = {}
    for step in range(steps):
        batch = [samples[i] for i in torch.randint(len(samples), (batch_size,)).tolist()]
        loss, metrics = ttt_loss_on_samples(model, drafter, batch, aux_layer_ids, ttt_steps, cfg.train.attention)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
    meta = {
        "quick_fit": {"steps": steps, "batch_size": batch_size, "lr": lr, "ttt_steps": ttt_steps, "seed": seed},
        "target_fingerprint": target.fingerprint,
        "final_metrics": metrics,
        "fit_seconds": round(time.perf_counter() - started, 1),
    }
    export_drafter(drafter.eval(), out_dir, meta=meta)
    atomic_write_json(out_dir / "quick_fit.json", meta)
    return out_dir
