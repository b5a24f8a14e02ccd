"""A target split into pipeline stages: contiguous decoder layers per Ray actor (one per device, across nodes).

For targets larger than one device (Kimi-K2.5: ~1T parameters). Stage k holds layers `[start_k, end_k)`; the first
stage also holds the embeddings, the last the final norm. Each stage is the model's own transformers class, built
on the meta device with every module the stage does not own replaced by a pass-through, and then loaded by
`from_pretrained`, which reads only the owned tensors (the checkpoint's weight conversions included, e.g. per-expert
weights fused into one MoE tensor). A stage runs the base model's own `forward` with the previous stage's output as
`inputs_embeds`, so position ids, rotary embeddings and the causal mask are computed exactly as the single-process
model computes them, for every family.

Each stage captures the aux layers it owns (layer-OUTPUT ids, see `draftline.target.capture`); the last stage
returns the final-norm output. `PipelinedTarget.capture_many` keeps several micro-batches in flight: stage k works
on micro-batch i while stage k+1 works on i-1 (each actor runs its calls in submission order; the driver chains
them through Ray object refs and never waits on an intermediate result).

`PipelinedTarget.capture(input_ids, attention_mask)` returns what `capture_aux_hidden(model, input_ids,
attention_mask, aux_layer_ids)` returns for the whole model in one process, bit for bit; offline extraction takes
either (`extract.pipeline`), and so can the online mode.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
from torch import nn

from draftline.config import ConfigError, PipelineConfig
from draftline.target.aux_layers import check_capture_ids
from draftline.target.load import read_target_config, target_fingerprint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StagePlan:
    """What one stage holds: decoder layers [start, end), plus the embeddings (first) or the final norm (last)."""

    index: int
    start: int
    end: int
    is_first: bool
    is_last: bool

    def owned_aux_ids(self, aux_layer_ids: Sequence[int]) -> list[int]:
        """The aux (layer-output) ids whose layer this stage runs."""
        return [layer_id for layer_id in aux_layer_ids if self.start <= layer_id < self.end]


def plan_stages(num_layers: int, pipeline: PipelineConfig) -> list[StagePlan]:
    """Contiguous layer ranges: `pipeline.layers_per_stage` when given, else as even as the count allows (the
    first stages take one layer more when it does not divide)."""
    stages = pipeline.stages
    if pipeline.layers_per_stage is not None:
        counts = list(pipeline.layers_per_stage)
        if len(counts) != stages or sum(counts) != num_layers:
            raise ConfigError(
                f"extract.pipeline.layers_per_stage {counts} must list {stages} counts (extract.pipeline.stages) "
                f"summing to the target's {num_layers} layers"
            )
    else:
        if stages > num_layers:
            raise ConfigError(
                f"extract.pipeline.stages is {stages} but the target has only {num_layers} layers: use at most "
                f"{num_layers} stages"
            )
        base, extra = divmod(num_layers, stages)
        counts = [base + (1 if index < extra else 0) for index in range(stages)]
    plans, start = [], 0
    for index, count in enumerate(counts):
        plans.append(StagePlan(index, start, start + count, is_first=index == 0, is_last=index == stages - 1))
        start += count
    return plans


class _HeldByAnotherStage(nn.Module):
    """Stands in for a module another stage holds: the hidden states pass through unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def _not_owned_key_patterns(plan: StagePlan, num_layers: int, prefix: str) -> list[str]:
    """Checkpoint keys of other stages (loaded by them): expected here, so not reported as unexpected."""
    other_layers = [i for i in range(num_layers) if not plan.start <= i < plan.end]
    patterns = [r"^lm_head\."]
    if other_layers:
        patterns.append(rf"^{re.escape(prefix)}\.layers\.({'|'.join(map(str, other_layers))})\.")
    if not plan.is_first:
        patterns.append(rf"^{re.escape(prefix)}\.embed_tokens\.")
    if not plan.is_last:
        patterns.append(rf"^{re.escape(prefix)}\.norm\.")
    return patterns


def _stage_model_class(model_class: type, plan: StagePlan, num_layers: int) -> type:
    """`model_class` whose constructor keeps only what `plan` owns (so from_pretrained loads nothing else)."""

    class StageModel(model_class):
        _keys_to_ignore_on_load_unexpected = _not_owned_key_patterns(plan, num_layers, model_class.base_model_prefix)

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            base_model = self.base_model
            for index in range(num_layers):
                if not plan.start <= index < plan.end:
                    base_model.layers[index] = _HeldByAnotherStage()
            if not plan.is_first:
                base_model.embed_tokens = _HeldByAnotherStage()
            if not plan.is_last:
                base_model.norm = _HeldByAnotherStage()
            # Extraction runs the base model only: no stage needs the LM head, so nothing is tied to it either.
            self.lm_head = _HeldByAnotherStage()
            self.all_tied_weights_keys = {}

    StageModel.__name__ = StageModel.__qualname__ = f"{model_class.__name__}Stage{plan.index}"
    return StageModel


def causal_lm_class(target_dir: str | Path, trust_remote_code: bool) -> tuple[type, object]:
    """The transformers causal-LM class of the target and its config (remote code resolved as from_pretrained does)."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    remote = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if remote and trust_remote_code:
        return get_class_from_dynamic_module(remote, str(target_dir)), config
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], config


def load_stage_model(
    target_dir: str | Path, plan: StagePlan, dtype: str, trust_remote_code: bool, device: str = "cpu"
) -> nn.Module:
    """The stage's part of the target, in `dtype` on `device`; every tensor it owns must come from the checkpoint."""
    model_class, config = causal_lm_class(target_dir, trust_remote_code)
    num_layers = config.num_hidden_layers
    stage_class = _stage_model_class(model_class, plan, num_layers)
    model, loading_info = stage_class.from_pretrained(
        target_dir, config=config, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code, output_loading_info=True
    )
    if loading_info["missing_keys"]:
        raise RuntimeError(
            f"stage {plan.index} (layers {plan.start}-{plan.end - 1}) of {target_dir}: the checkpoint lacks "
            f"{sorted(loading_info['missing_keys'])[:5]}; the target files are incomplete"
        )
    return model.to(device).eval()


class StageActor:
    """One pipeline stage (a Ray actor: `ray.remote(StageActor)`), on the device Ray gave it."""

    def __init__(
        self,
        target_dir: str,
        plan: StagePlan,
        aux_layer_ids: Sequence[int],
        dtype: str,
        trust_remote_code: bool,
        expected_fingerprint: str | None,
        torch_threads: int,
    ):
        if expected_fingerprint is not None and target_fingerprint(target_dir) != expected_fingerprint:
            raise RuntimeError(
                f"stage {plan.index}: target at {target_dir} has fingerprint {target_fingerprint(target_dir)}, the "
                f"driver saw {expected_fingerprint}; every node must have the same target files"
            )
        torch.set_num_threads(torch_threads)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.plan = plan
        self.model = load_stage_model(target_dir, plan, dtype, trust_remote_code, self.device)
        self.owned_aux_ids = plan.owned_aux_ids(aux_layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        layers = self.model.base_model.layers
        for layer_id in self.owned_aux_ids:
            layers[layer_id].register_forward_hook(self._capture_hook(layer_id))

    def _capture_hook(self, layer_id: int):
        def hook(module, args, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def forward(self, hidden_or_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, list]:
        """-> (this stage's output: hidden states for the next stage, or the final-norm output on the last stage;
        the owned aux states in layer order). All on CPU: they travel through Ray's object store."""
        inputs = {"input_ids": hidden_or_ids} if self.plan.is_first else {"inputs_embeds": hidden_or_ids}
        self._captured.clear()
        outputs = self.model.base_model(
            **{name: value.to(self.device) for name, value in inputs.items()},
            attention_mask=attention_mask.to(self.device),
            use_cache=False,
            return_dict=True,
        )
        aux = [self._captured[layer_id].to("cpu") for layer_id in self.owned_aux_ids]
        self._captured.clear()
        return outputs.last_hidden_state.to("cpu"), aux

    def node_and_device(self) -> dict:
        import ray

        return {"stage": self.plan.index, "node": ray.get_runtime_context().get_node_id(), "device": self.device}


class PipelinedTarget:
    """The target as a pipeline of stage actors, with the capture interface of `LocalTarget`.

    Resources per stage come from `extract.pipeline`; the stages are reserved as one placement group (PACK:
    consecutive stages share a node where they fit, and span nodes where they do not).
    """

    def __init__(
        self,
        target_dir: str | Path,
        aux_layer_ids: Sequence[int],
        pipeline: PipelineConfig,
        dtype: str,
        trust_remote_code: bool = False,
        expected_fingerprint: str | None = None,
        group_name: str | None = None,
    ):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        num_layers = int(read_target_config(target_dir)["num_hidden_layers"])
        check_capture_ids(aux_layer_ids, num_layers)
        self.aux_layer_ids = list(aux_layer_ids)
        self.plans = plan_stages(num_layers, pipeline)
        self.max_in_flight = pipeline.micro_batches_in_flight or 2 * len(self.plans)
        bundle = {"CPU": pipeline.cpus_per_stage, **({"GPU": pipeline.gpus_per_stage} if pipeline.gpus_per_stage else {})}
        if group_name is not None:
            # The same slot's group from an earlier attempt (a restarted worker group): its owner is gone, and Ray
            # would keep the group (and its GPUs) until the job ends.
            remove_stage_groups(group_name, exact=True)
        self._placement_group = placement_group([dict(bundle) for _ in self.plans], strategy="PACK", name=group_name or "")
        try:
            ray.get(self._placement_group.ready(), timeout=pipeline.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._placement_group)
            raise RuntimeError(
                f"the Ray cluster could not fit {len(self.plans)} pipeline stages of {bundle} each within "
                f"{pipeline.placement_timeout_s} s (free: {ray.available_resources()}); lower extract.pipeline.stages "
                "or its cpus_per_stage / gpus_per_stage, extract.num_workers, or add nodes"
            ) from None
        actor_class = ray.remote(StageActor)
        self.actors = [
            actor_class.options(
                num_cpus=pipeline.cpus_per_stage,
                num_gpus=pipeline.gpus_per_stage,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement_group, placement_group_bundle_index=plan.index),
            ).remote(
                str(target_dir), plan, self.aux_layer_ids, dtype, trust_remote_code, expected_fingerprint,
                max(1, int(pipeline.cpus_per_stage)),
            )  # fmt: skip
            for plan in self.plans
        ]
        self.layout = ray.get([actor.node_and_device.remote() for actor in self.actors])

    def _submit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[list, object]:
        """Chain one micro-batch through every stage without waiting: -> (aux refs per stage, final hidden ref)."""
        import ray

        mask_ref = ray.put(attention_mask)
        hidden_ref, aux_refs = input_ids, []
        for actor in self.actors:
            hidden_ref, aux_ref = actor.forward.options(num_returns=2).remote(hidden_ref, mask_ref)
            aux_refs.append(aux_ref)
        return aux_refs, hidden_ref

    def _collect(self, submitted: tuple[list, object]) -> tuple[torch.Tensor, torch.Tensor]:
        import ray

        aux_refs, final_ref = submitted
        aux_states = [state for per_stage in ray.get(aux_refs) for state in per_stage]
        return torch.cat(aux_states, dim=-1), ray.get(final_ref)

    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch -> (aux_hidden [B, T, n_aux*H], final_hidden [B, T, H]), as `capture_aux_hidden` returns."""
        return self._collect(self._submit(input_ids, attention_mask))

    def capture_many(
        self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches in, results out in the same order, with up to `max_in_flight` of them in the pipeline."""
        in_flight: deque = deque()
        for input_ids, attention_mask in batches:
            if len(in_flight) >= self.max_in_flight:
                yield self._collect(in_flight.popleft())
            in_flight.append(self._submit(input_ids, attention_mask))
        while in_flight:
            yield self._collect(in_flight.popleft())

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self._placement_group)


def remove_stage_groups(name: str, exact: bool = False) -> int:
    """Remove the stage placement groups named `name` (or, unless `exact`, starting with it) and with them their
    stage actors: -> how many. A placement group made inside a Ray actor (an extraction worker, an online target
    actor) outlives that actor until the whole job ends, so the driver removes its run's groups once the workers
    are done, killed ones included."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    removed = 0
    for info in placement_group_table().values():
        matches = info["name"] == name if exact else info["name"].startswith(name)
        if matches and info["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(info["placement_group_id"]))))
            removed += 1
    return removed
