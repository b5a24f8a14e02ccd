"""Train SpecForge 0.2.0's EAGLE-3 drafter with SpecForge's own model, loss, optimizer and export, on CPU.

Run by benchmarks/specforge_side_by_side.py with SpecForge's overlay first on the path (scripts/setup_peer_envs.sh:
PYTHONPATH=.peers/specforge, TORCHDYNAMO_DISABLE=1); it imports nothing of draftline.

    python benchmarks/specforge_train.py --train-features DIR --val-features DIR --draft-config FILE \
        --target-dir DIR --out DIR [--steps 100 --batch-size 4 --lr 1e-3 --warmup-steps 10 --ttt-length 3 ...]

What is SpecForge's and what is this file's. SpecForge's own code does all the maths and the formats:
- data: its offline feature files (`.ckpt`: input_ids, loss_mask, hidden_state, aux_hidden_state) listed by
  `list_feature_files`, read by `load_feature_file`, normalised by the EAGLE-3 offline normaliser
  (`normalize_offline_sample`) and padded by its `DataCollatorWithPadding`;
- the draft vocabulary: `generate_vocab_mapping_file` (the most frequent loss-masked tokens of the train files);
- the model: `build_eagle3_draft` (`AutoDraftModel.from_config`, vocab mapping, the target's embedding, frozen);
- the objective: `OnlineEagle3Model` (its TTT unroll, KL loss and accuracies) driven by `Eagle3TrainStrategy`
  (the frozen `TargetHead` over the stored final hidden state, the 0.8**k position weights);
- the optimizer: `BF16Optimizer` (AdamW over fp32 masters, grad-norm clip, warmup then cosine to 0);
- the checkpoint and export: `Eagle3TrainStrategy.checkpoint_state_filter` into `training_state.pt`, then
  `export_to_hf` (SpecForge's HF draft directory, bfloat16, the target's embedding included).
This file's own parts, where `specforge train` needs CUDA/NCCL (its FSDP backend, its data plane and controller):
the loop (one process, no FSDP: shuffle, collate, forward_loss, backward, step), the validation pass over the val
files with the same strategy under no_grad, and reading the target's lm_head (tied to the embedding in SmolLM2)
into `TargetHead` by hand (its `load_weights` reads index-sharded checkpoints only). Training runs in float32 on
CPU (SpecForge's default is bfloat16 on GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
from safetensors import safe_open


def _import_loss_without_triton() -> ModuleType:
    """specforge.core.loss, imported on a machine without triton.

    SpecForge's KL loss (`LogSoftmaxLoss`) is a Triton GPU kernel and its module imports triton at the top. Without
    triton the module is imported with a stand-in whose `jit` leaves the kernels as plain functions (never launched:
    `use_reference_loss` swaps the loss for the reference implementation in the same file). The stand-in lives only
    for this import: other packages (transformers) must still see that triton is absent."""
    import specforge.utils  # noqa: F401  (transformers imported before the stand-in exists)

    try:
        import triton  # noqa: F401
    except ImportError:
        stand_in, language = ModuleType("triton"), ModuleType("triton.language")
        stand_in.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
        language.constexpr = object
        stand_in.language = language
        sys.modules.update({"triton": stand_in, "triton.language": language})
        try:
            import specforge.core.loss as loss
        finally:
            del sys.modules["triton"], sys.modules["triton.language"]
        return loss
    import specforge.core.loss as loss

    return loss


specforge_loss = _import_loss_without_triton()

from specforge.algorithms.eagle3 import model as eagle3_model  # noqa: E402
from specforge.algorithms.eagle3.data import normalize_offline_sample  # noqa: E402
from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: E402
from specforge.algorithms.model_providers import build_eagle3_draft  # noqa: E402
from specforge.data.preprocessing import generate_vocab_mapping_file  # noqa: E402
from specforge.data.utils import DataCollatorWithPadding  # noqa: E402
from specforge.export.to_hf import export_to_hf  # noqa: E402
from specforge.modeling.auto import AutoDraftModelConfig  # noqa: E402
from specforge.modeling.target.target_head import TargetHead  # noqa: E402
from specforge.optimizer import BF16Optimizer  # noqa: E402
from specforge.runtime.contracts import TrainBatch  # noqa: E402
from specforge.runtime.data_plane.feature_store import load_feature_file  # noqa: E402
from specforge.runtime.data_plane.offline_reader import list_feature_files  # noqa: E402
from specforge.training.strategies.base import Eagle3TrainStrategy  # noqa: E402



class ReferenceLogSoftmaxLoss:
    """`LogSoftmaxLoss.apply(logits, target_p, position_mask)` computed by SpecForge's own reference implementation
    (`specforge.core.loss._compute_loss`: -sum(mask * p * log_softmax(logits)) averaged over batch x positions, the
    value the Triton kernel returns), differentiated by autograd."""

    apply = staticmethod(specforge_loss._compute_loss)


def use_reference_loss() -> None:
    eagle3_model.LogSoftmaxLoss = ReferenceLogSoftmaxLoss


LM_HEAD_KEYS = ("lm_head.weight", "model.embed_tokens.weight")  # the second where the target ties its embedding


class TokenColumns:
    """The two columns `generate_vocab_mapping_file` reads from a datasets.Dataset, over the feature files."""

    def __init__(self, files: list[str]):
        self.samples = [load_feature_file(f) for f in files]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, column: str) -> list[torch.Tensor]:
        return [sample[column] for sample in self.samples]


def target_head(target_dir: str) -> TargetHead:
    head = TargetHead(target_dir)
    with safe_open(os.path.join(target_dir, "model.safetensors"), framework="pt") as weights:
        key = next((k for k in LM_HEAD_KEYS if k in weights.keys()), None)
        if key is None:
            raise KeyError(f"{target_dir}/model.safetensors has none of {LM_HEAD_KEYS}")
        head.fc.weight.data.copy_(weights.get_tensor(key))
    head.freeze_weights()
    return head.eval().to(torch.float32)


def build(args, vocab_mapping: str) -> tuple[torch.nn.Module, Eagle3TrainStrategy]:
    """SpecForge's draft model and EAGLE-3 strategy, as its providers assemble them (float32, sdpa)."""
    cfg = SimpleNamespace(
        training=SimpleNamespace(attention_backend="sdpa", strategy="eagle3"),
        model=SimpleNamespace(torch_dtype="float32", draft_checkpoint_path=None, vocab_mapping_path=vocab_mapping,
                              load_target_embedding=True, target_model_path=args.target_dir,
                              embedding_key="model.embed_tokens.weight", cache_dir=None, trust_remote_code=False),
    )  # fmt: skip
    draft = build_eagle3_draft(cfg, AutoDraftModelConfig.from_file(args.draft_config))
    model = OnlineEagle3Model(draft_model=draft, length=args.ttt_length, attention_backend="sdpa").to(torch.float32)
    return model, Eagle3TrainStrategy(model, target_head=target_head(args.target_dir), ploss_decay=args.ploss_decay)


def batches(files: list[str], max_len: int, batch_size: int, shuffle_seed: int | None):
    """Collated batches of the files, in a seeded shuffled order (None: file order)."""
    order = list(range(len(files)))
    if shuffle_seed is not None:
        order = torch.randperm(len(files), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    collate = DataCollatorWithPadding()
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        samples = [normalize_offline_sample(load_feature_file(files[i]), max_len) for i in chosen]
        yield TrainBatch(sample_ids=[str(i) for i in chosen], strategy="eagle3", tensors=collate(samples),
                         metadata={"target_repr": "hidden_state"})  # fmt: skip


def train_batches(files: list[str], args):
    """Epoch after epoch, reshuffled each epoch (seed + epoch), full batches only, as a drop_last loader gives them."""
    epoch = 0
    while True:
        for batch in batches(files, args.max_len, args.batch_size, args.seed + epoch):
            if len(batch.sample_ids) == args.batch_size:
                yield batch
        epoch += 1


def validate(strategy: Eagle3TrainStrategy, files: list[str], args) -> dict[str, float]:
    """SpecForge's per-position accuracy (draft argmax == target argmax over its loss mask) over the val files."""
    correct, denom = [0.0] * args.ttt_length, [0.0] * args.ttt_length
    strategy.eagle3_model.eval()
    with torch.no_grad():
        for batch in batches(files, args.max_len, args.batch_size, None):
            metrics = strategy.forward_loss(batch).metrics
            for k in range(args.ttt_length):
                correct[k] += float(metrics["acc_corrects"][k])
                denom[k] += float(metrics["acc_denoms"][k])
    strategy.eagle3_model.train()
    return {f"val_acc_{k}": correct[k] / max(denom[k], 1.0) for k in range(args.ttt_length)}


def save_and_export(model, strategy: Eagle3TrainStrategy, args, vocab_mapping: str, step: int) -> None:
    """SpecForge's checkpoint of the draft (its strategy's key filter) and its HF export: `export/` for the last
    step, `export-step<N>/` for the steps before (a run stopped early still has its latest drafter)."""
    checkpoint = args.out / f"checkpoint-step{step}"
    checkpoint.mkdir(exist_ok=True)
    torch.save({"draft_state_dict": strategy.checkpoint_state_filter(model.state_dict())}, checkpoint / "training_state.pt")
    name = "export" if step == args.steps else f"export-step{step}"
    export_to_hf(str(checkpoint), args.draft_config, str(args.out / name), vocab_mapping_path=vocab_mapping,
                 embedding_source=args.target_dir)  # fmt: skip


def write_history(args, train_files: int, history: list[dict]) -> None:
    (args.out / "history.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "train_files": train_files, "history": history}))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-features", required=True)
    parser.add_argument("--val-features", required=True)
    parser.add_argument("--draft-config", required=True, help="the draft model's config.json (LlamaForCausalLMEagle3)")
    parser.add_argument("--target-dir", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--ttt-length", type=int, default=3)
    parser.add_argument("--ploss-decay", type=float, default=0.8)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (draftline's curve: 1 CPU per worker)")
    parser.add_argument("--val-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    use_reference_loss()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    train_files, val_files = list_feature_files(args.train_features), list_feature_files(args.val_features)
    target_vocab = int(json.loads((Path(args.target_dir) / "config.json").read_text())["vocab_size"])
    draft_vocab = int(json.loads(Path(args.draft_config).read_text())["draft_vocab_size"])
    vocab_mapping = generate_vocab_mapping_file(TokenColumns(train_files), target_vocab, draft_vocab,
                                                cache_dir=str(args.out), cache_key="vocab_mapping")  # fmt: skip
    model, strategy = build(args, vocab_mapping)
    optimizer = BF16Optimizer(model, lr=args.lr, max_grad_norm=args.grad_clip, total_steps=args.steps,
                              warmup_ratio=args.warmup_steps / args.steps)  # fmt: skip
    history, started = [], time.monotonic()
    for step, batch in enumerate(train_batches(train_files, args), start=1):
        output = strategy.forward_loss(batch)
        output.loss.backward()
        optimizer.step()
        row = {"step": step, "loss": float(output.loss), "acc": [float(a) for a in output.metrics["acces"]],
               "lr": optimizer.get_learning_rate(), "s": round(time.monotonic() - started, 1)}  # fmt: skip
        history.append(row)
        if step % args.val_every == 0 or step == args.steps:
            row.update(validate(strategy, val_files, args))
            save_and_export(model, strategy, args, vocab_mapping, step)
            write_history(args, len(train_files), history)
        print(json.dumps(row), flush=True)
        if step == args.steps:
            break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
