"""SGLangEngine process management and protocol, without a GPU.

These tests drive the engine against tests/fake_sglang_server.py: a real HTTP server in a real subprocess that
speaks SGLang's /health, /generate (streaming and not) and /get_model_info, launched through the engine's
`launcher` hook in place of `python -m sglang.launch_server` (the rest of the command is the real, preflighted
one). The real server is exercised by scripts/gpu_smoke.sh on a GPU machine.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from draftline.engines.base import SamplingParams
from draftline.engines.sglang.engine import SGLangEngine, SGLangError, spec_stats_from_meta
from draftline.engines.sglang.preflight import PreflightError
from conftest import free_port, make_test_config

FAKE_SERVER = [sys.executable, str(Path(__file__).parents[1] / "fake_sglang_server.py")]


def sglang_config(extra=()):
    return make_test_config(
        extra=[
            "engine.backend=sglang",
            f"engine.sglang.port={free_port()}",
            "engine.sglang.startup_timeout_s=20",
            "engine.sglang.max_restarts=2",
            *extra,
        ]
    )


async def collect(engine, prompt, params):
    return [chunk async for chunk in engine.generate(prompt, params)]


def test_streams_tokens_and_spec_stats_from_a_server_process(tiny_target_dir, random_drafter_dir, caplog):
    caplog.set_level("INFO", logger="draftline.sglang")
    engine = SGLangEngine(sglang_config(), tiny_target_dir, random_drafter_dir, model_version="7", launcher=FAKE_SERVER)

    async def scenario():
        await engine.start()
        try:
            assert await engine.health()
            info = await engine.model_info()
            chunks = await collect(engine, [5, 9, 100], SamplingParams(max_new_tokens=7))
            stopped = await collect(engine, [5, 9, 100], SamplingParams(max_new_tokens=20, stop_token_ids=[104]))
            both = await asyncio.gather(*(collect(engine, [i], SamplingParams(max_new_tokens=3)) for i in (10, 20)))
            return info, chunks, stopped, both
        finally:
            await engine.stop()

    info, chunks, stopped, both = asyncio.run(scenario())
    assert info["model_path"] == str(tiny_target_dir)
    assert [t for c in chunks for t in c.token_ids] == list(range(101, 108))
    assert [len(c.token_ids) for c in chunks] == [2, 2, 2, 1]  # cumulative output_ids turned into deltas
    assert "".join(c.text for c in chunks) == "".join(f" t{t}" for t in range(101, 108))
    final = chunks[-1]
    assert final.finished and final.finish_reason == "length" and all(not c.finished for c in chunks[:-1])
    assert (final.stats.verify_steps, final.stats.output_tokens, final.stats.accepted_draft_tokens) == (4, 7, 3)
    assert final.stats.accept_length == pytest.approx(7 / 4)
    assert [t for c in stopped for t in c.token_ids] == [101, 102, 103, 104] and stopped[-1].finish_reason == "stop"
    assert [[t for c in r for t in c.token_ids] for r in both] == [[11, 12, 13], [21, 22, 23]]
    assert any("--speculative-draft-model-path" in line for line in engine.recent_log_lines)  # forwarded logs
    assert any("fake-sglang: generate" in record.getMessage() for record in caplog.records)


def test_target_only_launches_without_speculative_flags(tiny_target_dir):
    engine = SGLangEngine(sglang_config(), tiny_target_dir, None, launcher=FAKE_SERVER)
    assert not any(arg.startswith("--speculative") for arg in engine.launch_argv())
    assert engine.model_version == "target-only"

    async def scenario():
        await engine.start()
        try:
            return await collect(engine, [1], SamplingParams(max_new_tokens=3))
        finally:
            await engine.stop()

    chunks = asyncio.run(scenario())
    assert [len(c.token_ids) for c in chunks] == [1, 1, 1]
    assert chunks[-1].stats.verify_steps == 0 and chunks[-1].stats.output_tokens == 3


def test_crashed_server_is_restarted(tiny_target_dir, random_drafter_dir, tmp_path, monkeypatch):
    """The fake server exits in the middle of the first request; the engine restarts it and serves again."""
    monkeypatch.setenv("FAKE_SGLANG_CRASH_FILE", str(tmp_path / "crashed-once"))
    monkeypatch.setattr("draftline.engines.server_process.RESTART_BACKOFF_S", (0.2,))
    engine = SGLangEngine(sglang_config(), tiny_target_dir, random_drafter_dir, launcher=FAKE_SERVER)

    async def scenario():
        await engine.start()
        first_pid = engine.server.pid
        try:
            with pytest.raises(SGLangError, match="closed the stream"):
                await collect(engine, [1], SamplingParams(max_new_tokens=8))
            chunks = await collect(engine, [1], SamplingParams(max_new_tokens=4))  # waits for the restart
            return first_pid, engine.server.pid, chunks, await engine.health()
        finally:
            await engine.stop()

    first_pid, second_pid, chunks, healthy = asyncio.run(scenario())
    assert first_pid != second_pid and engine.restarts == 1 and healthy
    assert [t for c in chunks for t in c.token_ids] == [2, 3, 4, 5]
    assert any("crashing on purpose" in line for line in engine.recent_log_lines)


def test_server_that_cannot_start_fails_with_its_log(tiny_target_dir, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_EXIT_AT_START", "7")
    engine = SGLangEngine(sglang_config(), tiny_target_dir, None, launcher=FAKE_SERVER)

    async def scenario():
        try:
            await engine.start()
        finally:
            await engine.stop()

    with pytest.raises(SGLangError, match="exited with code 7 before it was healthy(.|\n)*cannot start"):
        asyncio.run(scenario())


def test_preflight_errors_refuse_to_launch(tiny_target_dir, random_drafter_dir):
    cfg = sglang_config(["engine.sglang.extra_args=['--no-such-flag']"])
    engine = SGLangEngine(cfg, tiny_target_dir, random_drafter_dir, launcher=FAKE_SERVER)
    with pytest.raises(PreflightError, match="no-such-flag"):
        asyncio.run(engine.start())
    assert engine.server.pid is None


def test_spec_stats_read_every_version_field_name():
    new = spec_stats_from_meta({"completion_tokens": 9, "spec_verify_ct": 3, "spec_num_correct_drafts": 6})
    old = spec_stats_from_meta({"completion_tokens": 9, "spec_verify_ct": 3, "spec_accept_token_num": 6})
    plain = spec_stats_from_meta({"completion_tokens": 9})
    assert (new.verify_steps, new.accepted_draft_tokens, new.accept_length) == (3, 6, 3.0)
    assert (old.verify_steps, old.accepted_draft_tokens) == (3, 6)
    assert (plain.verify_steps, plain.output_tokens, plain.accept_length) == (0, 9, 0.0)


def test_factory_builds_the_configured_backend(tiny_target_dir):
    from draftline.engines import ENGINE_BACKENDS, make_engine

    assert set(ENGINE_BACKENDS) == {"reference", "sglang", "vllm"}
    assert isinstance(make_engine(sglang_config(), tiny_target_dir), SGLangEngine)
