"""SGLangEngine: an SGLang server subprocess behind the Engine protocol.

- Launch: `build_launch_argv(cfg, target, drafter)` (checked by the preflight: a command with errors is refused
  before anything starts), run with `start_new_session` so the server and its scheduler/detokenizer children
  can be stopped as one process group. Without a drafter the same server runs without speculation.
- Process: `engines/server_process.py` supervises it, as for vLLM: ready when GET /health answers 200 (at most
  `engine.sglang.startup_timeout_s`; a server that exits first fails the start with its last log lines), relaunched
  with exponential backoff when it exits unasked (at most `engine.sglang.max_restarts` times; requests wait for
  it), stopped as one process group, every output line sent to the `draftline.sglang` logger.
- Requests: POST /generate with `input_ids` and `stream: true` (httpx), SSE `data: {...}` events until
  `data: [DONE]`. SGLang streams cumulative `output_ids` by default (incremental with
  --incremental-streaming-output); both are handled by comparing with `meta_info.completion_tokens`.
- Stats: `meta_info` fields (tokenizer_manager.py): `spec_verify_ct` (0.5.6 .. 0.5.23), accepted drafts as
  `spec_num_correct_drafts` (0.5.23) or `spec_accept_token_num` (0.5.6); `completion_tokens`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import AsyncIterator, Optional

from draftline.config import DraftlineConfig, SpeculativeConfig
from draftline.engines.base import TARGET_ONLY, GenerationChunk, SamplingParams, SpecStats
from draftline.engines.server_process import ServerError, ServerProcess, sse_events
from draftline.engines.sglang.launch import build_launch_argv

logger = logging.getLogger("draftline.sglang")


class SGLangError(ServerError):
    pass


def spec_stats_from_meta(meta: dict) -> SpecStats:
    completion = int(meta.get("completion_tokens", 0))
    verify = int(meta.get("spec_verify_ct", 0) or 0)
    accepted = meta.get("spec_num_correct_drafts", meta.get("spec_accept_token_num"))
    if accepted is None:
        accepted = max(completion - verify, 0) if verify else 0  # every verify step emits one bonus token
    return SpecStats(verify_steps=verify, accepted_draft_tokens=int(accepted), output_tokens=completion)


def finish_reason_of(meta: dict) -> Optional[str]:
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind == "abort":
        message = reason.get("message", "") if isinstance(reason, dict) else ""
        raise SGLangError(f"SGLang aborted the request: {message or reason}")
    return kind


class SGLangEngine:
    name = "sglang"

    def __init__(
        self,
        cfg: DraftlineConfig,
        target_dir: str | Path,
        drafter_dir: Optional[str | Path] = None,
        model_version: Optional[str] = None,
        speculative: Optional[SpeculativeConfig] = None,
        launcher: Optional[list[str]] = None,
    ) -> None:
        """launcher replaces `python -m sglang.launch_server` in the command (tests run a fake server with it)."""
        self.cfg = cfg.model_copy(deep=True)
        if speculative is not None:
            self.cfg.engine.speculative = speculative
        if drafter_dir is None:
            self.cfg.engine.speculative.algorithm = ""  # same server, no speculation
        self.target_dir = Path(target_dir)
        self.drafter_dir = Path(drafter_dir) if drafter_dir is not None else None
        self.model_version = model_version or (TARGET_ONLY if drafter_dir is None else str(self.drafter_dir))
        self.launcher = launcher
        sglang = self.cfg.engine.sglang
        self.base_url = f"http://{sglang.host}:{sglang.port}"
        self.server = ServerProcess(
            "SGLang", self.launch_argv, None, lambda: self.base_url, "/health", sglang.startup_timeout_s,
            sglang.max_restarts, logger, timeout_hint="raise engine.sglang.startup_timeout_s: large models load slowly",
        )  # fmt: skip
        self._client = None

    @property
    def restarts(self) -> int:
        return self.server.restarts

    @property
    def recent_log_lines(self):
        return self.server.recent_log_lines

    # -------------------------------------------------------------------------------------------- lifecycle

    def launch_argv(self) -> list[str]:
        """The checked SGLang command (raises PreflightError listing every problem)."""
        argv = build_launch_argv(self.cfg, self.target_dir, self.drafter_dir)
        if self.launcher is not None:
            argv = list(self.launcher) + argv[3:]  # argv[:3] is `python -m sglang.launch_server`
        return argv

    async def start(self) -> None:
        import httpx

        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(None, connect=10.0))
        try:
            await self.server.start()
        except ServerError as err:
            await self.stop()
            raise SGLangError(str(err)) from None
        except Exception:  # the preflight refused the command (PreflightError): nothing was started
            await self.stop()
            raise

    async def health(self) -> bool:
        return self.server.running and await self.server.healthy()

    async def model_info(self) -> dict:
        response = await self._client.get("/get_model_info")
        response.raise_for_status()
        return response.json()

    def server_cpu_seconds(self) -> float:
        """CPU seconds of the server's process tree so far (the bench's CPU-time figures)."""
        return self.server.cpu_seconds()

    async def stop(self) -> None:
        await self.server.stop()
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    # ------------------------------------------------------------------------------------------ generation

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        if self._client is None:
            raise SGLangError("SGLangEngine.generate before start(): await engine.start() first")
        sampling = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        body = {"input_ids": list(prompt_ids), "sampling_params": sampling, "stream": True}
        async for chunk in self.server.stream(lambda: self._stream(body), SGLangError):
            yield chunk

    async def _stream(self, body: dict) -> AsyncIterator[GenerationChunk]:
        async with self._client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                raise SGLangError(f"SGLang /generate answered {response.status_code}: {detail}")
            async for chunk in _chunks_of(response):
                yield chunk


async def _chunks_of(response) -> AsyncIterator[GenerationChunk]:
    """SSE events of a streaming /generate -> chunks holding only the new tokens and text."""
    received = text_sent = 0
    async for event in sse_events(response, SGLangError, "SGLang /generate"):
        meta = event.get("meta_info", {})
        output_ids = list(event.get("output_ids") or [])
        text = event.get("text", "")
        # SGLang's default streams cumulative output_ids/text; --incremental-streaming-output streams deltas.
        cumulative = len(output_ids) == int(meta.get("completion_tokens", -1)) and len(output_ids) >= received
        new_ids = output_ids[received:] if cumulative else output_ids
        new_text = text[text_sent:] if cumulative else text
        received += len(new_ids)
        text_sent = len(text) if cumulative else text_sent
        reason = finish_reason_of(meta)
        yield GenerationChunk(
            token_ids=new_ids,
            text=new_text,
            finished=reason is not None,
            finish_reason=reason,
            stats=spec_stats_from_meta(meta) if reason is not None else None,
        )
