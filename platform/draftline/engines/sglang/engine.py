"""SGLangEngine: an SGLang server subprocess behind the Engine protocol.

- Launch: `build_launch_argv(cfg, target, drafter)` (checked by the preflight: a command with errors is refused
  before anything starts), run with `start_new_session` so the server and its scheduler/detokenizer children
  can be stopped as one process group. Without a drafter the same server runs without speculation.
- Ready: polls GET /health until 200, at most `engine.sglang.startup_timeout_s`; a server that exits first fails
  the start with its last log lines.
- Requests: POST /generate with `input_ids` and `stream: true` (httpx), SSE `data: {...}` events until
  `data: [DONE]`. SGLang streams cumulative `output_ids` by default (incremental with
  --incremental-streaming-output); both are handled by comparing with `meta_info.completion_tokens`.
- Stats: `meta_info` fields (tokenizer_manager.py): `spec_verify_ct` (0.5.6 .. 0.5.23), accepted drafts as
  `spec_num_correct_drafts` (0.5.23) or `spec_accept_token_num` (0.5.6); `completion_tokens`.
- Crashes: a watcher restarts a server that exits unexpectedly, with exponential backoff, at most
  `engine.sglang.max_restarts` times; requests wait for the restarted server (up to the startup timeout).
- Logs: every server output line goes to the `draftline.sglang` logger (and the last lines are kept for errors).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import AsyncIterator, Optional

from draftline.config import DraftlineConfig, SpeculativeConfig
from draftline.engines.base import TARGET_ONLY, GenerationChunk, SamplingParams, SpecStats

logger = logging.getLogger("draftline.sglang")

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)
STOP_GRACE_S = 15.0


class SGLangError(RuntimeError):
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
        self.restarts = 0
        self.recent_log_lines: collections.deque[str] = collections.deque(maxlen=200)
        self._process: Optional[asyncio.subprocess.Process] = None
        self._ready = asyncio.Event()
        self._stopping = False
        self._failed: Optional[str] = None
        self._tasks: list[asyncio.Task] = []
        self._client = None

    # -------------------------------------------------------------------------------------------- lifecycle

    def launch_argv(self) -> list[str]:
        """The checked SGLang command (raises PreflightError listing every problem)."""
        from draftline.engines.sglang.args import build_launch_argv

        argv = build_launch_argv(self.cfg, self.target_dir, self.drafter_dir)
        if self.launcher is not None:
            argv = list(self.launcher) + argv[3:]  # argv[:3] is `python -m sglang.launch_server`
        return argv

    async def start(self) -> None:
        import httpx

        argv = self.launch_argv()
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(None, connect=10.0))
        self._stopping = False
        await self._launch(argv)
        self._tasks.append(asyncio.create_task(self._watch(argv), name="sglang-watch"))

    async def _launch(self, argv: list[str]) -> None:
        self._ready.clear()
        logger.info("launching: %s", " ".join(argv))
        self._process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        self._tasks.append(asyncio.create_task(self._forward_logs(self._process), name="sglang-logs"))
        await self._wait_healthy(self._process)
        self._ready.set()

    async def _forward_logs(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.recent_log_lines.append(line)
            logger.info("[sglang pid %s] %s", process.pid, line)

    async def _wait_healthy(self, process: asyncio.subprocess.Process) -> None:
        timeout_s = self.cfg.engine.sglang.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.returncode is not None:
                raise SGLangError(
                    f"SGLang exited with code {process.returncode} before it was healthy; last log lines:\n"
                    + "\n".join(list(self.recent_log_lines)[-20:])
                )
            try:
                response = await self._client.get("/health", timeout=5.0)
                if response.status_code == 200:
                    return
            except Exception:  # connection refused while the server is loading
                pass
            await asyncio.sleep(0.25)
        await self._terminate(process)
        raise SGLangError(
            f"SGLang at {self.base_url} was not healthy within engine.sglang.startup_timeout_s={timeout_s}; "
            "raise the timeout (large models load slowly) or read the log lines above"
        )

    async def _watch(self, argv: list[str]) -> None:
        """Restart a server that exits while nobody asked it to stop."""
        while not self._stopping:
            process = self._process
            code = await process.wait()
            if self._stopping:
                return
            self._ready.clear()
            if self.restarts >= self.cfg.engine.sglang.max_restarts:
                self._failed = (
                    f"SGLang exited with code {code} and engine.sglang.max_restarts="
                    f"{self.cfg.engine.sglang.max_restarts} restarts are used up"
                )
                logger.error(self._failed)
                self._ready.set()  # wake waiting requests so they fail fast
                return
            backoff_s = RESTART_BACKOFF_S[min(self.restarts, len(RESTART_BACKOFF_S) - 1)]
            self.restarts += 1
            logger.warning("SGLang exited with code %s; restart %d in %.0f s", code, self.restarts, backoff_s)
            await asyncio.sleep(backoff_s)
            try:
                await self._launch(argv)
            except SGLangError as err:
                logger.error("restart %d failed: %s", self.restarts, err)

    async def health(self) -> bool:
        if self._failed or self._process is None or self._process.returncode is not None or not self._ready.is_set():
            return False
        try:
            return (await self._client.get("/health", timeout=5.0)).status_code == 200
        except Exception:
            return False

    async def model_info(self) -> dict:
        response = await self._client.get("/get_model_info")
        response.raise_for_status()
        return response.json()

    async def stop(self) -> None:
        self._stopping = True
        if self._process is not None:
            await self._terminate(self._process)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _terminate(self, process: asyncio.subprocess.Process) -> None:
        if process.returncode is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                await asyncio.wait_for(process.wait(), wait_s)
                return
            except asyncio.TimeoutError:
                continue

    # ------------------------------------------------------------------------------------------ generation

    async def _wait_ready(self) -> None:
        timeout_s = self.cfg.engine.sglang.startup_timeout_s
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise SGLangError(f"SGLang at {self.base_url} did not come back within {timeout_s} s") from None
        if self._failed:
            raise SGLangError(self._failed)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        if self._client is None:
            raise SGLangError("SGLangEngine.generate before start(): await engine.start() first")
        await self._wait_ready()
        sampling = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        body = {"input_ids": list(prompt_ids), "sampling_params": sampling, "stream": True}
        for attempt in range(self.cfg.engine.sglang.max_restarts + 1):
            try:
                async for chunk in self._stream(body):
                    yield chunk
                return
            except _NotConnected:
                # The server went away between requests: the watcher is restarting it. Nothing was streamed yet,
                # so the request can be sent again once it is back.
                await asyncio.sleep(0.5)
                await self._wait_ready()
        raise SGLangError(f"SGLang at {self.base_url} refused connections {self.cfg.engine.sglang.max_restarts + 1} times")

    async def _stream(self, body: dict) -> AsyncIterator[GenerationChunk]:
        import httpx

        streamed = False
        try:
            async with self._client.stream("POST", "/generate", json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:500]
                    raise SGLangError(f"SGLang /generate answered {response.status_code}: {detail}")
                async for chunk in _chunks_of(response):
                    streamed = True
                    yield chunk
                    if chunk.finished:
                        return
        except httpx.ConnectError:
            raise _NotConnected() from None
        except httpx.TransportError as err:
            if not streamed:
                # A pooled connection to a server that has just died (before the watcher saw it exit): nothing
                # reached the caller, so the request can be sent again once the server is back.
                raise _NotConnected() from None
            raise SGLangError(f"SGLang closed the stream mid-request (did the server crash?): {err!r}") from None
        raise SGLangError("SGLang closed the stream before the request finished (did the server crash?)")


async def _chunks_of(response) -> AsyncIterator[GenerationChunk]:
    """SSE events of a streaming /generate -> chunks holding only the new tokens and text."""
    received = text_sent = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            raise SGLangError(f"SGLang /generate error: {event['error']}")
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


class _NotConnected(Exception):
    """The server refused the connection before anything was sent back."""
