"""The engine deployment: one engine per replica, swapped in place when the served version changes.

- A replica learns which drafter to serve from its Serve `user_config` (`ServedModel`).
- A new user_config reaches every replica through Serve's rolling reconfigure. Inside a replica the new engine is
  started and health-checked *beside* the old one; the replica swaps only when the new engine is healthy.
  Requests already running finish on the engine they started on; the old engine stops once it is idle (or after
  serve.drain_timeout_s). So every response comes whole from one version. If the new engine cannot start, the
  replica keeps serving the old version and reports the error (`served()`), which `roll_to` turns into a failure.
- serve.rollout=drain_and_swap instead holds one engine per replica at a time (GPU replicas, where a second copy
  of the target does not fit): new requests wait while running ones finish, then the engine is replaced; Serve
  reconfigures replicas a fraction at a time, so with num_replicas >= 2 the others keep answering meanwhile.
- serve.rollout=blue_green needs nothing here: a replica serves one version for its life; a rollout is a new set
  of replicas in a Serve app of its own (control.py).
- `start_engine` is the one place an engine is constructed (reference, vLLM, SGLang via draftline.engines).
"""

# No `from __future__ import annotations`: Serve wraps these methods.
import asyncio
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from ray import serve

from draftline.config import DraftlineConfig, SpeculativeConfig
from draftline.engines import make_engine
from draftline.engines.base import SamplingParams
from draftline.serving.metrics import EngineMetrics
from draftline.serving.openai_schema import ServedVersion
from draftline.serving.served_model import ServedModel
from draftline.target.load import resolve_target_dir

logger = logging.getLogger("ray.serve")

ENGINE_DEPLOYMENT = "DraftlineEngine"


async def start_engine(cfg: DraftlineConfig, target_dir: Path, wanted: ServedModel) -> Any:
    """Construct, start and health-check the engine for `wanted` (the one place replicas build engines)."""
    engine = make_engine(
        cfg,
        target_dir,
        drafter_dir=Path(wanted.export_dir) if wanted.export_dir else None,
        model_version=wanted.model_version,
        speculative=SpeculativeConfig(**wanted.speculative) if wanted.speculative else None,
    )
    await engine.start()
    if not await engine.health():
        await engine.stop()
        raise RuntimeError(f"engine {engine.name} started but reports unhealthy")
    return engine


class _LiveEngine:
    """An engine plus its in-flight request count, so a replaced engine stops only when idle."""

    def __init__(self, engine: Any, served: ServedModel) -> None:
        self.engine = engine
        self.served = served
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def retire(self, drain_timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=drain_timeout_s)
        except asyncio.TimeoutError:
            logger.warning(
                "engine for version %s still had %d requests after %.0f s; stopping it anyway",
                self.served.model_version,
                self.in_flight,
                drain_timeout_s,
            )
        await self.engine.stop()


@serve.deployment(name=ENGINE_DEPLOYMENT)
class EngineServer:
    """One engine (SGLang on GPU, the reference engine on CPU) per replica; the version comes from user_config."""

    def __init__(self, config: dict) -> None:
        self._cfg = DraftlineConfig.model_validate(config)
        self._target_dir = resolve_target_dir(self._cfg)
        self._live: Optional[_LiveEngine] = None
        self._swap_lock = asyncio.Lock()
        self._retiring: set[asyncio.Task] = set()
        self._last_error: Optional[str] = None
        self._metrics = EngineMetrics()
        self._accepting = asyncio.Event()
        self._accepting.set()

    async def reconfigure(self, user_config: dict) -> None:
        wanted = ServedModel.model_validate(user_config)
        async with self._swap_lock:
            if self._live is not None and self._live.served == wanted:
                self._last_error = None  # asked back to what it serves (a failed rollout being undone)
                return
            if self._live is not None and self._cfg.serve.rollout == "drain_and_swap":
                await self._drain_and_swap(wanted)
                return
            try:
                engine = await start_engine(self._cfg, self._target_dir, wanted)
            except Exception as err:  # noqa: BLE001 - the old engine keeps serving; the error is reported
                self._last_error = f"could not start version {wanted.model_version} from {wanted.export_dir}: {err!r}"
                if self._live is None:
                    raise RuntimeError(self._last_error) from err
                logger.error("%s; still serving version %s", self._last_error, self._live.served.model_version)
                return
            old, self._live = self._live, _LiveEngine(engine, wanted)
            self._last_error = None
            self._metrics.record_swap(self._cfg.engine.backend, wanted.model_version, old and old.served.model_version)
            logger.info(
                "now serving %s version %s%s",
                wanted.registered_model,
                wanted.model_version,
                f" (replaced {old.served.model_version})" if old else "",
            )
            if old is not None:
                task = asyncio.create_task(old.retire(self._cfg.serve.drain_timeout_s))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    async def _drain_and_swap(self, wanted: ServedModel) -> None:
        """One engine at a time (a GPU holds one copy of the target): new requests wait, running ones finish, the old
        engine stops, the new one starts. If it cannot, the old version is started again and the error reported."""
        old = self._live
        self._accepting.clear()
        try:
            await old.retire(self._cfg.serve.drain_timeout_s)
            try:
                engine, served = await start_engine(self._cfg, self._target_dir, wanted), wanted
                self._last_error = None
            except Exception as err:  # noqa: BLE001 - bring the old version back; the error is reported
                self._last_error = f"could not start version {wanted.model_version} from {wanted.export_dir}: {err!r}"
                logger.error("%s; starting version %s again", self._last_error, old.served.model_version)
                engine, served = await start_engine(self._cfg, self._target_dir, old.served), old.served
            self._live = _LiveEngine(engine, served)
            if served == wanted:
                self._metrics.record_swap(self._cfg.engine.backend, wanted.model_version, old.served.model_version)
                logger.info("now serving %s version %s (drained and replaced %s)", wanted.registered_model,
                            wanted.model_version, old.served.model_version)
        finally:
            self._accepting.set()

    def _served_version(self, live: _LiveEngine) -> dict:
        return ServedVersion(
            registered_model=live.served.registered_model,
            model_version=live.served.model_version,
            backend=self._cfg.engine.backend,
        ).model_dump()

    async def generate(self, prompt_ids: list[int], params: dict) -> AsyncIterator[dict]:
        """Stream chunks as dicts; every chunk names the version, which stays the same for the whole request."""
        await self._accepting.wait()  # closed only while drain_and_swap replaces the engine
        live = self._live
        if live is None:
            raise RuntimeError("no engine is loaded yet (reconfigure has not run)")
        served = self._served_version(live)
        live.enter()
        try:
            async for chunk in live.engine.generate(prompt_ids, SamplingParams(**params)):
                yield {
                    "token_ids": list(chunk.token_ids),
                    "text": chunk.text,
                    "finished": chunk.finished,
                    "finish_reason": chunk.finish_reason,
                    "stats": asdict(chunk.stats) if chunk.stats is not None else None,
                    "served": served,
                }
        finally:
            live.leave()

    async def served(self) -> dict:
        """The version this replica serves, its engine's health, and the last failed swap (if any)."""
        live = self._live
        return {
            "served": self._served_version(live) if live else None,
            "user_config": live.served.model_dump() if live else None,
            "healthy": bool(live) and await live.engine.health(),
            "last_error": self._last_error,
            "replica": serve.get_replica_context().replica_id.unique_id,
        }

    async def check_health(self) -> None:
        if not self._accepting.is_set():
            return  # mid drain_and_swap: the engine is being replaced on purpose
        if self._live is None or not await self._live.engine.health():
            raise RuntimeError("engine is not loaded or reports unhealthy")

    async def __del__(self) -> None:
        if self._live is not None:
            await self._live.engine.stop()
