"""Regenerate through a running OpenAI-compatible server: draftline's own Serve endpoint (real Ray Serve, real HTTP on
127.0.0.1), target only. vLLM's and SGLang's servers take the same `/v1/completions` request with token-id prompts;
the greedy replies must equal those the reference engine gives in-process."""

from __future__ import annotations

import json
import shutil

import pytest

from registry_helpers import mlflow_test_config
from conftest import free_port
from serve_helpers import start_serving, stop_serving

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_regenerate_through_openai_server_matches_reference(ray_cluster, tmp_path, tiny_target_dir):
    from draftline.regenerate.run import output_dir, regenerate

    source = tmp_path / "source.jsonl"
    source.write_text("".join((tiny_target_dir / "conversations.jsonl").read_text().splitlines(True)[:8]))
    common = [f"data.conversations={source}", "regenerate.enabled=true", "regenerate.max_new_tokens_per_turn=16",
              "regenerate.conversations_per_shard=3", "serve.max_ongoing_requests=4"]
    # The shared test data dir holds the cached target the Serve replicas load; MLflow (no champion) is in tmp_path.
    cfg = mlflow_test_config(tmp_path, common + [f"serve.port={free_port()}"])
    url = start_serving(cfg)
    try:
        served_cfg = cfg.model_copy(update={"regenerate": cfg.regenerate.model_copy(update={"openai_base_urls": [f"{url}/v1"]})})
        shutil.rmtree(output_dir(served_cfg, tiny_target_dir), ignore_errors=True)  # really ask the server
        served = regenerate(served_cfg, tiny_target_dir)
    finally:
        stop_serving()
    reference = regenerate(cfg, tiny_target_dir)

    manifest = json.loads((served.out_dir / "manifest.json").read_text())
    assert manifest["engine"] == {"backend": "openai-server", "model": None, "base_urls": [f"{url}/v1"]}
    assert served.shards_generated == 3 and served.conversations == reference.conversations == 8
    assert served.output_tokens > 0 and served.out_dir != reference.out_dir

    def replies(result):
        return [[m["content"] for m in json.loads(line)["messages"] if m["role"] == "assistant"]
                for line in (result.out_dir / "conversations.jsonl").read_text().splitlines()]

    assert replies(served) == replies(reference)
