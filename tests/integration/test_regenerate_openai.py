"""Regenerate through real servers, target only: a running OpenAI-compatible server (draftline's own Serve endpoint:
real Ray Serve, real HTTP on 127.0.0.1, `/v1/completions` with token-id prompts), and vLLM's own api_server (its CPU
build in .venv-vllm) started by the replica as `engine.backend`. The greedy replies must equal those the reference
engine gives in-process."""

from __future__ import annotations

import json
from pathlib import Path
import shutil

import pytest

from registry_helpers import mlflow_test_config
from conftest import VLLM_TEST_OVERRIDES, free_port
from serve_helpers import start_serving, stop_serving


CONVERSATIONS = 8


@pytest.fixture
def regenerate_overrides(tmp_path, tiny_target_dir) -> list[str]:
    """The first 8 of the target's own conversations, 16 tokens per turn, 3 per shard."""
    source = tmp_path / "source.jsonl"
    source.write_text("".join((tiny_target_dir / "conversations.jsonl").read_text().splitlines(True)[:CONVERSATIONS]))
    return [f"data.conversations={source}", "regenerate.enabled=true", "regenerate.max_new_tokens_per_turn=16",
            "regenerate.conversations_per_shard=3", "serve.max_ongoing_requests=4", f"serve.port={free_port()}"]


@pytest.fixture
def regenerate_cfg(tmp_path, regenerate_overrides):
    # The shared test data dir holds the cached target the servers load; MLflow (no champion) is in tmp_path.
    return mlflow_test_config(tmp_path, regenerate_overrides)


def regenerate_through(cfg, target_dir, base_url: str):
    """regenerate against the server at base_url (an OpenAI /v1 URL), never from a cached output."""
    from draftline.data.sources import output_dir
    from draftline.regenerate.run import regenerate

    regenerate_cfg = cfg.regenerate.model_copy(update={"openai_base_urls": [base_url]})
    served_cfg = cfg.model_copy(update={"regenerate": regenerate_cfg})
    shutil.rmtree(output_dir(served_cfg, target_dir), ignore_errors=True)  # really ask the server
    return regenerate(served_cfg, target_dir)


def replies(result) -> list[list[str]]:
    return [[m["content"] for m in json.loads(line)["messages"] if m["role"] == "assistant"]
            for line in (result.out_dir / "conversations.jsonl").read_text().splitlines()]


def check_against_reference(served, cfg, target_dir, base_url: str) -> None:
    from draftline.regenerate.run import regenerate

    reference = regenerate(cfg, target_dir)
    manifest = json.loads((served.out_dir / "manifest.json").read_text())
    assert manifest["engine"] == {"backend": "openai-server", "model": None, "base_urls": [base_url]}
    assert served.shards_generated == 3 and served.conversations == reference.conversations == CONVERSATIONS
    assert served.output_tokens > 0 and served.out_dir != reference.out_dir
    assert replies(served) == replies(reference)


def test_regenerate_through_draftline_serve_matches_reference(ray_cluster, regenerate_cfg, tiny_target_dir):
    url = start_serving(regenerate_cfg)
    try:
        served = regenerate_through(regenerate_cfg, tiny_target_dir, f"{url}/v1")
    finally:
        stop_serving()
    check_against_reference(served, regenerate_cfg, tiny_target_dir, f"{url}/v1")


def replica_actors() -> dict[str, int]:
    """actor id -> pid of the RegenerateReplica actors of the test's own cluster (with no address, Ray's state API
    fails when other Ray instances run on the machine)."""
    import ray
    from ray.util.state import list_actors

    actors = list_actors(address=ray.get_runtime_context().gcs_address,
                         filters=[("class_name", "=", "RegenerateReplica")], limit=10000)
    return {actor.actor_id: actor.pid for actor in actors}


def replica_log(pids: list[int]) -> list[str]:
    """What the replicas wrote on stderr (Python's logging), from the local session's worker log files. Read from disk,
    not through Ray's log API, which needs the node's dashboard agent: under load the agent was gone ("Agent for
    node id ... doesn't exist") and the test failed after a good run."""
    from ray._private.worker import global_worker  # the local session's log directory has no public accessor

    logs = Path(global_worker.node.get_logs_dir_path())
    files = [path for pid in pids for path in sorted(logs.glob(f"worker-*-{pid}.err"))]
    assert len(files) >= len(pids), f"no worker log for pids {pids} in {logs}"
    return [line for path in files for line in path.read_text(errors="replace").splitlines()]


def test_regenerate_with_the_vllm_engine_matches_reference(ray_cluster, tmp_path, regenerate_overrides,
                                                          regenerate_cfg, tiny_target_dir):
    """regenerate.engine.backend=vllm while the serving engine stays the reference one: the regenerate replica
    starts vLLM 0.32's CPU api_server itself (one start-up, --enforce-eager) and sends its turns there through the
    vLLM engine, many in flight. Its input is the user turns alone (prompt-only, regenerate's usual input). Once done,
    the replica stops its server before it is killed: before, Ray SIGKILLed the server as the replica exited, and the
    replica's log said `vLLM exited with code -9; restart 1 in 1 s` after a successful run."""
    from draftline.data.sources import output_dir
    from draftline.regenerate.run import regenerate

    prompts = tmp_path / "prompts.jsonl"
    source = next(o.split("=", 1)[1] for o in regenerate_overrides if o.startswith("data.conversations="))
    prompts.write_text("".join(
        json.dumps({"id": r["id"], "turns": [m["content"] for m in r["messages"] if m["role"] == "user"]}) + "\n"
        for r in map(json.loads, open(source))))
    own_engine = [o.replace("engine.", "regenerate.engine.", 1) for o in VLLM_TEST_OVERRIDES]
    vllm_cfg = mlflow_test_config(tmp_path, regenerate_overrides + own_engine + [f"data.conversations={prompts}"])
    assert vllm_cfg.engine.backend == "reference"
    shutil.rmtree(output_dir(vllm_cfg, tiny_target_dir), ignore_errors=True)
    replicas_before = replica_actors()
    served = regenerate(vllm_cfg, tiny_target_dir)
    replicas = {actor_id: pid for actor_id, pid in replica_actors().items() if actor_id not in replicas_before}
    assert len(replicas) == 1
    log = replica_log(list(replicas.values()))
    assert [line for line in log if "exited with code" in line or "restart" in line] == []
    reference = regenerate(regenerate_cfg, tiny_target_dir)

    manifest = json.loads((served.out_dir / "manifest.json").read_text())
    assert manifest["engine"] == {"backend": "vllm", "device": "cpu"}
    assert served.shards_generated == 3 and served.conversations == reference.conversations == CONVERSATIONS
    assert served.output_tokens > 0 and served.out_dir != reference.out_dir
    assert replies(served) == replies(reference)
