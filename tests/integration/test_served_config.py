"""The served configuration from measurement: a version's stored bench sweep decides the speculative settings its
replicas start with (a real sqlite MLflow store, a random drafter registered as the train stage registers one, the
reference engine started as a Serve replica starts it)."""

from __future__ import annotations

import asyncio

from draftline.bench.run import store_bench_on_version
from draftline.registry import promote
from draftline.serving.engine_server import start_engine
from draftline.serving.served_model import resolve_served_model
from draftline.tracking import GATE_TAG
from registry_helpers import mlflow_test_config, random_drafter, register_drafter


def test_serving_uses_the_speculative_settings_the_bench_sweep_measured(tmp_path, tiny_target_dir):
    """`draftline bench --sweep` stores the fastest (steps, topk, draft tokens) per concurrency on the version; the
    champion is served with the entry for the highest benched concurrency a replica reaches (serve.max_ongoing_requests),
    and a version without a sweep with engine.speculative."""
    cfg = mlflow_test_config(tmp_path)
    version = register_drafter(cfg, random_drafter(tiny_target_dir), tags={GATE_TAG: "passed"})
    promote(cfg, version)
    assert resolve_served_model(cfg).speculative is None
    best = {"1": {"num_steps": 5, "eagle_topk": 1, "num_draft_tokens": 6, "output_tokens_per_s": 50.0, "speedup": 1.4,
                  "accept_length": 2.5},
            "4": {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3, "output_tokens_per_s": 90.0, "speedup": 1.1,
                  "accept_length": 2.1}}
    store_bench_on_version(cfg, version, {"rows": [], "best": best})
    served = resolve_served_model(cfg)
    assert cfg.serve.max_ongoing_requests >= 4 and (served.speculative["num_steps"], served.speculative["num_draft_tokens"]) == (2, 3)
    one_at_a_time = cfg.model_copy(deep=True)
    one_at_a_time.serve.max_ongoing_requests = 2
    served = resolve_served_model(one_at_a_time)
    assert (served.speculative["num_steps"], served.speculative["eagle_topk"], served.speculative["num_draft_tokens"]) == (5, 1, 6)


    async def started_spec():
        engine = await start_engine(one_at_a_time, tiny_target_dir, served)
        try:
            return engine.spec.num_steps, engine.spec.num_draft_tokens
        finally:
            await engine.stop()

    assert asyncio.run(started_spec()) == (5, 6)
