"""A target split into pipeline stages (draftline.target.stages) captures exactly what the whole target captures.

Stage actors run on the real local Ray cluster (the `ray_cluster` fixture), each loading only its layers with the
model's own transformers class. Compared in fp32 with atol 0: the test-size Llama target through `draftline extract`
(2 stages), and a random-weight test-size DeepSeek-V3 target (MLA, dense first layer then MoE with a shared expert,
YaRN; 3 stages, uneven split). Every stage actor starts a Python process that imports torch and transformers, so
the other families run their stages in this process instead (`StageActor` unwrapped): Qwen3 and Qwen3-MoE (fused
expert weights loaded from per-expert checkpoint tensors), 4 stages of 2 layers each.
"""

from __future__ import annotations

import time

import pytest
import torch

from draftline.config import ConfigError, PipelineConfig
from draftline.extract.shards import num_shards
from draftline.extract.storage import Storage
from draftline.extract.worker import SplitTokens, right_padded_batch, run_worker_shards
from draftline.target.capture import capture_aux_hidden
from draftline.target.stages import PipelinedTarget, plan_stages

AUX_LAYER_IDS = [1, 3, 6]  # the test target's default for its 8 layers, [1, n//2 - 1, n - 2]: the last stage owns one


def test_stage_plans_are_contiguous_and_bad_splits_name_the_field():
    even = plan_stages(8, PipelineConfig(stages=3))
    assert [(p.start, p.end) for p in even] == [(0, 3), (3, 6), (6, 8)]
    assert [(p.is_first, p.is_last) for p in even] == [(True, False), (False, False), (False, True)]
    assert even[1].owned_aux_ids(AUX_LAYER_IDS) == [3]
    explicit = plan_stages(61, PipelineConfig(stages=3, layers_per_stage=[21, 20, 20]))
    assert [(p.start, p.end) for p in explicit] == [(0, 21), (21, 41), (41, 61)]
    with pytest.raises(ConfigError, match="extract.pipeline.layers_per_stage"):
        plan_stages(8, PipelineConfig(stages=2, layers_per_stage=[3, 4]))
    with pytest.raises(ConfigError, match="extract.pipeline.stages is 9"):
        plan_stages(8, PipelineConfig(stages=9))


def _random_target(tmp_path_factory, tiny_cfg, family: str):
    """A test-size target of `family` with random weights (what is compared is the computation, not the quality)."""
    from transformers import AutoModelForCausalLM

    from draftline.target.families import build_model_config

    emb = tiny_cfg.target.embedded
    emb = emb.model_copy(update={"family": family, "num_key_value_heads": emb.num_attention_heads})
    config = build_model_config(emb, {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    torch.manual_seed(0)
    target_dir = tmp_path_factory.mktemp(family)
    AutoModelForCausalLM.from_config(config).save_pretrained(target_dir)
    return target_dir


@pytest.fixture(scope="module")
def pipeline(ray_cluster, tiny_cfg, tmp_path_factory, one_torch_thread):
    """(whole model in this process, the same target as 3 stage actors: layers 0-2, 3-5, 6-7)."""
    from transformers import AutoModelForCausalLM

    target_dir = _random_target(tmp_path_factory, tiny_cfg, "deepseek-v3")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    pipelined = PipelinedTarget(target_dir, AUX_LAYER_IDS, PipelineConfig(stages=3, cpus_per_stage=0.5), "float32")
    yield model, pipelined
    pipelined.shutdown()


def _sequences(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 40, (count,), generator=generator)
    return [torch.randint(3, 256, (int(length),), generator=generator) for length in lengths]


def test_pipelined_capture_is_bit_identical_to_the_whole_model(pipeline):
    model, pipelined = pipeline
    assert len({stage["stage"] for stage in pipelined.layout}) == len(pipelined.plans)
    sequences = _sequences(12, seed=1)
    batches = [right_padded_batch(sequences[start : start + 3], pad_id=0) for start in range(0, len(sequences), 3)]
    pipelined_results = list(pipelined.capture_many(batches))  # 4 micro-batches in flight through the stages
    assert len(pipelined_results) == len(batches)
    for (input_ids, attention_mask), (aux, final) in zip(batches, pipelined_results):
        expected_aux, expected_final = capture_aux_hidden(model, input_ids, attention_mask, AUX_LAYER_IDS)
        assert aux.shape == expected_aux.shape and aux.dtype == torch.float32
        assert torch.equal(aux, expected_aux), (aux - expected_aux).abs().max()
        assert torch.equal(final, expected_final), (final - expected_final).abs().max()


def test_extraction_shards_through_the_pipeline_are_byte_identical(pipeline, tmp_path):
    """The offline extract path (`run_worker_shards`, as the worker calls it when extract.pipeline is set)."""
    model, pipelined = pipeline
    sequences = _sequences(7, seed=2)
    split_tokens = SplitTokens.from_samples(
        [{"input_ids": s.tolist(), "loss_mask": [index % 2] * len(s)} for index, s in enumerate(sequences)]
    )
    plan = {"aux_layer_ids": AUX_LAYER_IDS, "samples_per_shard": 4, "batch_size": 2, "pad_id": 0, "dtype": "float32",
            "shard_metadata": {"format": "draftline-hidden-states"}}  # fmt: skip
    stores = {name: Storage(str(tmp_path / name)) for name in ("whole", "stages")}
    assert run_worker_shards(model, split_tokens, stores["whole"], 0, 1, plan)["written"] == 2
    assert run_worker_shards(pipelined, split_tokens, stores["stages"], 0, 1, plan)["written"] == 2
    for shard_index in range(num_shards(len(split_tokens), plan["samples_per_shard"])):
        name = f"shard-{shard_index:05d}.safetensors"
        assert stores["stages"].read_bytes(name) == stores["whole"].read_bytes(name)


def test_extract_with_extract_pipeline_stores_what_the_whole_model_captures(
    ray_cluster, tiny_dataset_dir, tmp_path, one_torch_thread
):
    """`draftline extract` with the config switch: the Ray Train worker drives 2 stage actors instead of loading
    the target; every stored sample equals the whole model's capture over the same batches, bit for bit."""
    from conftest import make_test_config
    from draftline.data.prepare import load_split
    from draftline.extract.run import extract_with_stats
    from draftline.extract.shards import HiddenStateShards
    from draftline.extract.worker import hidden_states_for_samples
    from draftline.target.load import load_target

    cfg = make_test_config(extra=[
        f"extract.storage_uri={tmp_path / 'hidden'}", "extract.samples_per_shard=8", "extract.batch_size=3",
        "extract.cpus_per_worker=0.5", "extract.pipeline.stages=2", "extract.pipeline.cpus_per_stage=0.5",
    ])  # fmt: skip
    result = extract_with_stats(cfg, tiny_dataset_dir, split="val")
    assert _live_stage_groups() == [], "the run's stage placement groups outlived it, holding their CPUs/GPUs"
    shards = HiddenStateShards(result.splits["val"].location)
    shards.verify()
    target = load_target(cfg)
    ids = shards.manifest["aux_layer_ids"]
    sequences = [torch.tensor(sample["input_ids"]) for sample in load_split(tiny_dataset_dir, "val")]
    assert len(shards) == len(sequences)
    for start in range(0, len(sequences), 8):  # one shard: the worker batches within it
        expected = hidden_states_for_samples(target.model, sequences[start : start + 8], ids, 3, 0, torch.float32)
        for offset, (aux, final) in enumerate(expected):
            stored = shards[start + offset]
            assert torch.equal(stored["aux_hidden"], aux) and torch.equal(stored["final_hidden"], final)


def _live_stage_groups() -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [info["name"] for info in placement_group_table().values()
            if info["name"].startswith("draftline-stages-") and info["state"] != "REMOVED"]  # fmt: skip


def test_a_killed_owners_stage_group_is_removed_by_name_with_its_stage_actors(ray_cluster, tiny_target_dir):
    """Ray keeps a placement group made inside an actor until the job ends, after that actor is killed (seen: two
    such groups held 2 of the 4 CPUs of a later online run, which then waited forever for its target actors).
    The driver's `remove_stage_groups(prefix)` frees them, and their stage actors with them."""
    import ray

    from draftline.target.stages import remove_stage_groups

    @ray.remote(num_cpus=0)
    class Owner:  # as an extraction worker or an online target actor holds its pipeline
        def start(self, target_dir: str) -> list:
            self.pipelined = PipelinedTarget(target_dir, AUX_LAYER_IDS, PipelineConfig(stages=2, cpus_per_stage=0.5),
                                             "float32", group_name="draftline-stages-test-rank0")
            return self.pipelined.actors

    owner = Owner.remote()
    stage_actors = ray.get(owner.start.remote(str(tiny_target_dir)))
    ray.kill(owner)
    time.sleep(2)
    assert _live_stage_groups() == ["draftline-stages-test-rank0"], "Ray removed it: the driver's cleanup is moot"
    assert remove_stage_groups("draftline-stages-test") == 1
    assert _live_stage_groups() == []
    for actor in stage_actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.node_and_device.remote(), timeout=60)


def test_stages_the_cluster_cannot_fit_fail_with_what_to_change(ray_cluster, tiny_target_dir):
    too_big = PipelineConfig(stages=2, cpus_per_stage=1000, placement_timeout_s=2)
    with pytest.raises(RuntimeError, match="could not fit 2 pipeline stages .* lower extract.pipeline.stages"):
        PipelinedTarget(tiny_target_dir, AUX_LAYER_IDS, too_big, "float32")


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_stages_in_this_process_chain_to_the_whole_model(family, tiny_cfg, tmp_path_factory, one_torch_thread):
    from transformers import AutoModelForCausalLM

    from draftline.target.stages import StageActor

    target_dir = _random_target(tmp_path_factory, tiny_cfg, family)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    stages = [StageActor(str(target_dir), plan, AUX_LAYER_IDS, "float32", False, None, 1)
              for plan in plan_stages(model.config.num_hidden_layers, PipelineConfig(stages=4))]  # fmt: skip
    # Each stage holds only its part, and together they hold the base model once (the LM head is not needed).
    stage_params = [sum(p.numel() for p in stage.model.parameters()) for stage in stages]
    assert sum(stage_params) == sum(p.numel() for p in model.base_model.parameters())
    assert max(stage_params) < sum(stage_params) / 2
    input_ids, attention_mask = right_padded_batch(_sequences(3, seed=3), pad_id=0)
    hidden, aux = input_ids, []
    for stage in stages:
        hidden, owned = stage.forward(hidden, attention_mask)
        aux += owned
    expected_aux, expected_final = capture_aux_hidden(model, input_ids, attention_mask, AUX_LAYER_IDS)
    assert torch.equal(torch.cat(aux, dim=-1), expected_aux)
    assert torch.equal(hidden, expected_final)


def test_kimi_layout_fits_h200s_by_the_models_own_parameter_count():
    """configs/kimi-k2.5.yaml's stage layout, checked against Kimi-K2.5's text shape built on the meta device with
    transformers' DeepSeek-V3 class (no weights): every stage's weights in bf16 plus the activation and context
    budget of the config's arithmetic (6 GB) fit one 141 GB H200, and the whole target does not fit one node."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from conftest import REPO
    from draftline.config import load_config

    cfg = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    dense_layers = 1  # layer 0 dense, the rest MoE: a 2-layer skeleton has one of each (building 61 costs 20 s)
    shape = DeepseekV3Config(
        vocab_size=cfg.target.vocab_size, hidden_size=cfg.target.hidden_size, num_hidden_layers=2,
        intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=64, num_key_value_heads=64,
        n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        first_k_dense_replace=dense_layers, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape)
    base = model.model

    def params(module) -> int:
        return sum(p.numel() for p in module.parameters())

    layer_params = [params(base.layers[0 if i < dense_layers else 1]) for i in range(cfg.target.num_layers)]
    bytes_per_weight, h200_bytes, budget_bytes = 2, 141e9, 6e9
    assert cfg.target.dtype == "bfloat16" and cfg.extract.pipeline.gpus_per_stage == 1
    stage_bytes = []
    for plan in plan_stages(cfg.target.num_layers, cfg.extract.pipeline):
        owned = sum(layer_params[plan.start : plan.end])
        owned += params(base.embed_tokens) if plan.is_first else 0
        owned += params(base.norm) if plan.is_last else 0
        stage_bytes.append(owned * bytes_per_weight)
    assert max(stage_bytes) + budget_bytes <= h200_bytes, [round(b / 1e9, 1) for b in stage_bytes]
    assert round(max(stage_bytes) / 1e9, 1) == 102.4  # the figures written beside the config
    whole = sum(layer_params) + 2 * params(base.embed_tokens) + params(base.norm)  # with the LM head
    assert round(whole / 1e12, 2) == 1.03
    assert whole * bytes_per_weight > 8 * h200_bytes  # why one node is not enough
    assert 4 * layer_params[1] * bytes_per_weight + budget_bytes > h200_bytes  # why 3 layers per stage at most


def test_online_target_actor_drives_the_stage_actors_and_streams_the_whole_models_capture(
    ray_cluster, tiny_target_dir, tiny_dataset_dir, tmp_path, one_torch_thread
):
    """Online mode with `extract.pipeline`: the target actor (built here in the driver, as Ray Data builds it in its
    actor) holds no weights and drives 2 stage actors; the rows it streams, val rows and a micro-batch of train
    rows, equal bit for bit those of a target actor holding the whole model."""
    import numpy as np
    import ray

    from conftest import make_test_config
    from draftline.extract.job import CaptureJob
    from draftline.extract.online import TRAIN, VAL, StreamCursor, TargetCapture
    from draftline.target.stages import PipelinedTarget
    from draftline.train.run import online_inputs

    rows = {"split": np.array([VAL] * 5 + [TRAIN] * 4), "step": np.ones(9, dtype=np.int64),
            "sample_index": np.array([0, 1, 2, 3, 4, 7, 0, 12, 3])}
    outputs = {}
    for name, extra in (("whole", []), ("stages", ["extract.pipeline.stages=2", "extract.pipeline.cpus_per_stage=0.5"])):
        cfg = make_test_config(tmp_path, ["extract.mode=online", "extract.batch_size=3", *extra])
        online = online_inputs(cfg, tiny_dataset_dir, tiny_target_dir).online
        refs = {split: ray.put(tokens) for split, tokens in online["split_tokens"].items()}
        cursor = ray.remote(num_cpus=0)(StreamCursor).remote()
        capture = TargetCapture(CaptureJob(cfg, online["plan"], refs, cursor, rank=0))
        assert isinstance(capture.model, PipelinedTarget) == (name == "stages")
        try:
            outputs[name] = capture(dict(rows))
        finally:
            if name == "stages":
                capture.model.shutdown()
    for column in ("aux_hidden", "final_hidden", "input_ids", "loss_mask"):
        assert len(outputs["stages"][column]) == len(outputs["whole"][column]) == 9
        for got, want in zip(outputs["stages"][column], outputs["whole"][column]):
            assert got.dtype == want.dtype and np.array_equal(got, want)
