"""vLLM's CPU build (.venv-vllm) serving the gpt-oss shape twin (sliding windows alternating with full attention,
attention sinks, its MoE) with an EAGLE-3 draft through draftline's vLLM engine: greedy on a prompt three windows
long, its tokens are the reference engine's target-only tokens (themselves HF generate's, tests/integration/
test_twins.py), and vLLM reads the aux ids the export wrote for it. The draft is random (exported like a trained
one): losslessness does not depend on what it proposes, and one vLLM start-up with no drafter training keeps this
cheap. The Gemma 3 twin is not served here: vLLM 0.32's Gemma3ForCausalLM has no EAGLE-3 interface, which the
preflight refuses (tests/integration/test_aux_layers.py asks vLLM's own classes)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from conftest import VLLM_TEST_OVERRIDES, prompt_past_window, twin_config
from draftline.drafter.export import META_FILE, export_drafter
from draftline.engines import make_engine
from draftline.engines.base import SamplingParams
from draftline.target.bootstrap import bootstrap_target
from registry_helpers import random_drafter
from vllm_helpers import AUX_IDS_LOGGED, VLLMLogLines

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TWIN = "gpt-oss-20b"
MAX_NEW_TOKENS = 24


async def _serve(engine, prompt: list[int]) -> tuple[list[int], int]:
    """-> (the greedy reply, vLLM's count of verify steps that checked drafts)."""
    await engine.start()
    try:
        tokens = []
        async for chunk in engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW_TOKENS)):
            tokens += chunk.token_ids
        return tokens, (await engine.spec_counters()).drafts
    finally:
        await engine.stop()


def test_vllm_serves_the_gpt_oss_twin_with_a_drafter_token_identical_to_the_target(tmp_path):
    cfg = twin_config(TWIN)
    target_dir = bootstrap_target(cfg)
    reference = make_engine(cfg, target_dir)
    reference.load()
    prompt = prompt_past_window(cfg, target_dir, reference.model.config.sliding_window)
    expected, _ = reference.generate_ids(prompt, SamplingParams(max_new_tokens=MAX_NEW_TOKENS))

    drafter_dir = export_drafter(random_drafter(target_dir, cfg.data.draft_vocab_size, seed=1), tmp_path / "drafter")
    engine = make_engine(twin_config(TWIN, VLLM_TEST_OVERRIDES), target_dir, drafter_dir, model_version="random")
    logger, lines = logging.getLogger("draftline.vllm"), VLLMLogLines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        served, drafts = asyncio.run(_serve(engine, prompt))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert served == expected
    assert drafts > 0, "vLLM verified no drafts: the drafter was not used"
    written = json.loads((drafter_dir / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    trained = json.loads((drafter_dir / META_FILE).read_text())["aux_layer_ids"]
    logged = [tuple(int(i) for i in m.group(1).split(",") if i.strip()) for m in map(AUX_IDS_LOGGED.search, lines.lines) if m]
    assert logged == [tuple(written)] == [tuple(i + 1 for i in trained)], (logged, written, trained)
