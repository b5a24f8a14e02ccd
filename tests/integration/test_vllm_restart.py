"""vLLM's CPU build, for real (.venv-vllm from `make setup-vllm`): a crashed server is relaunched, a stop leaves nothing.

Two server start-ups (minutes each on CPU), so the test is marked slow; --enforce-eager skips torch.compile.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from conftest import VLLM_TEST_OVERRIDES, make_test_config



def test_a_crashed_server_is_restarted_and_a_stop_leaves_nothing(tiny_target_dir):
    from draftline.engines import make_engine
    from draftline.engines.base import SamplingParams

    cfg = make_test_config(extra=VLLM_TEST_OVERRIDES + ["engine.vllm.max_restarts=1"])
    params = SamplingParams(max_new_tokens=8)

    async def generate(engine) -> list[int]:
        return [t async for chunk in engine.generate([1, 5, 9, 13], params) for t in chunk.token_ids]

    async def scenario() -> None:
        engine = make_engine(cfg, tiny_target_dir)
        await engine.start()
        try:
            first = await generate(engine)
            assert len(first) == 8
            crashed_pid = engine.server.pid
            await engine.server.kill()  # SIGKILL to the server's process group, as a crash would
            assert await generate(engine) == first  # waits for the watcher's relaunch, then answers the same
            assert engine.restarts == 1 and engine.server.pid != crashed_pid and await engine.health()
        finally:
            pid = engine.server.pid
            await engine.stop()
        # Nothing of the server's process group is left (SIGKILLed workers may take a moment to be reaped by init).
        for _ in range(40):
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            await asyncio.sleep(0.25)
        pytest.fail(f"processes of the vLLM server's group {pid} are still alive 10 s after stop()")

    asyncio.run(scenario())
