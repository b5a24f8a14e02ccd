"""Multi-node on this machine (issue 18): a head and two worker nodes, each its own Ray process tree on 127.0.0.1 with
token auth (tests/multinode_helpers.py). Extraction and training run as Ray Train groups spread over the nodes; a
whole worker node is SIGKILLed mid-extraction and mid-training, and the node of one of two serving replicas under
load. Real Ray, DeepSpeed, MLflow and HTTP.

A worker of the group holds at the fault hook (DRAFTLINE_TEST_FAULT_ACTION=hold) so the node dies at a known point:
after a known number of shards, after a known committed checkpoint. Each node has 1 CPU and a group has 2 workers,
so the two workers run on two different nodes and the restarted group fits on the two that survive.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from draftline.data.prepare import load_split
from draftline.extract.run import FAULT_AFTER_SHARDS_ENV, FAULT_MARKER_ENV, extract_with_stats
from draftline.extract.shards import HiddenStateShards, num_shards
from draftline.train.loop import KILL_AT_STEP_ENV, KILL_MARKER_ENV
from draftline.train.run import train
from draftline.utils import FAULT_ACTION_ENV, free_port
from tests.conftest import make_test_config, start_session_ray
from tests.multinode_helpers import (
    HEAD,
    joined,
    kill_node_of_held_worker,
    node_of_each_node_resource,
    start_multinode_cluster,
    train_worker_actors,
)
from tests.train_helpers import hidden_states_of_test_target, short_run_config

# A cluster start and two worker-group starts per test: 14 min for the extraction test at load 14-95 (2 cores).
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(2400)]


@pytest.fixture
def multinode():
    """A fresh head + 2 worker nodes per test (each test kills one); the session's local Ray, if this process was
    connected to it, is shut down first (one cluster of ours at a time) and started again afterwards."""
    import ray
    from ray import serve

    was_connected = ray.is_initialized()
    if was_connected:
        serve.shutdown()
        ray.shutdown()
    cluster = start_multinode_cluster(worker_nodes=2, num_cpus=1, head_cpus=1)
    try:
        assert node_of_each_node_resource(cluster) == cluster.node_ids, "a task pinned to a node ran elsewhere"
        yield cluster
    finally:
        cluster.shutdown()
        if was_connected:
            start_session_ray()


def _check_spread_and_restart(cluster, held, label: str) -> None:
    """The group ran on two nodes when one died; the workers started after that ran on surviving nodes only."""
    dead = held.kill.name
    assert len(set(held.workers_at_kill.values())) == 2, f"{label}: workers were not spread: {held.workers_at_kill}"
    assert dead in held.workers_at_kill.values(), f"{label}: the killed node {dead} ran none of the group's workers"
    restarted = {a.actor_id: cluster.name_of(a.node_id) for a in train_worker_actors()
                 if a.actor_id not in held.workers_at_kill}
    assert len(restarted) >= 2, f"{label}: Ray Train did not start a new worker group: {restarted}"
    assert dead not in restarted.values(), f"{label}: a restarted worker ran on the dead node {dead}: {restarted}"
    print(f"{label}: workers on {sorted(held.workers_at_kill.values())} when {dead} was killed "
          f"({held.kill.processes} processes); restarted on {sorted(restarted.values())}")


SHARDS_BEFORE_HOLD = 2


def test_extraction_finishes_after_a_worker_node_dies(multinode, tiny_dataset_dir, tmp_path, monkeypatch):
    marker = tmp_path / "worker-held"
    monkeypatch.setenv(FAULT_AFTER_SHARDS_ENV, str(SHARDS_BEFORE_HOLD))
    monkeypatch.setenv(FAULT_MARKER_ENV, str(marker))
    monkeypatch.setenv(FAULT_ACTION_ENV, "hold")
    hidden = tmp_path / "hidden"
    cfg = make_test_config(extra=[
        f"extract.storage_uri={hidden}", "extract.num_workers=2", "extract.samples_per_shard=8",
        "extract.max_failures=2",
    ])
    samples = load_split(tiny_dataset_dir, "train")
    total_shards = num_shards(len(samples), 8)
    killer = kill_node_of_held_worker(multinode, marker, count_records=lambda: len(list(hidden.glob("*/train/shard-*.json"))))
    started = time.monotonic()
    result = extract_with_stats(cfg, tiny_dataset_dir, split="train")
    finished = time.monotonic()
    held = joined(killer)

    assert held.kill.node_id not in multinode.alive_node_ids()
    assert SHARDS_BEFORE_HOLD <= held.shard_records_at_kill < total_shards, "the node died before or after the run"
    _check_spread_and_restart(multinode, held, "extract")

    split_dir = Path(result.location) / "train"
    shards = HiddenStateShards(split_dir)
    shards.verify()
    seen = [shards[i]["sample_index"] for i in range(len(shards))]
    assert sorted(seen) == list(range(len(samples))), "every sample exactly once"
    for index in (0, len(samples) // 2, len(samples) - 1):
        assert shards[index]["input_ids"].tolist() == samples[index]["input_ids"]
    records = [json.loads(p.read_text()) for p in sorted(split_dir.glob("shard-*.json"))]
    kept = [r for r in records if r["finished_unix"] <= held.kill.killed_at_unix]
    redone = [r for r in records if r["finished_unix"] > held.kill.killed_at_unix]
    assert len(kept) >= held.shard_records_at_kill, "shards finished before the node died were written again"
    assert redone, "the restarted group wrote nothing"
    resumed_s = min(r["started_unix"] for r in redone) - held.kill.killed_at_unix
    print(f"extract: {len(samples)} samples in {total_shards} shards; {held.shard_records_at_kill} written when "
          f"{held.kill.name} died, {len(redone)} after; the restarted group began its first shard {resumed_s:.1f} s "
          f"after the kill and finished {finished - held.kill.killed_at_monotonic:.1f} s after it "
          f"({finished - started:.1f} s in all)")


MAX_STEPS = 8
HOLD_AT_STEP = 5  # after the step-3 checkpoint is committed, before the step-6 one


def test_training_resumes_on_the_surviving_nodes(multinode, tiny_cfg, tiny_target_dir, tiny_dataset_dir, tmp_path,
                                                  monkeypatch):
    from mlflow import MlflowClient

    from tests.e2e.test_train_fault import expected_tokens_seen

    hidden_dir = hidden_states_of_test_target(tiny_cfg, tiny_dataset_dir)  # cached by hash after the first run
    marker = tmp_path / "rank-held"
    monkeypatch.setenv(KILL_AT_STEP_ENV, str(HOLD_AT_STEP))
    monkeypatch.setenv(KILL_MARKER_ENV, str(marker))
    monkeypatch.setenv(FAULT_ACTION_ENV, "hold")
    cfg = short_run_config(tmp_path, [f"train.max_steps={MAX_STEPS}", "train.max_failures=2"])
    killer = kill_node_of_held_worker(multinode, marker)
    result = train(cfg, hidden_dir, tiny_dataset_dir, tiny_target_dir)
    finished = time.monotonic()
    held = joined(killer)

    _check_spread_and_restart(multinode, held, "train")
    client = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
    resumed = client.get_metric_history(result.run_id, "resumed_at_step")
    assert [m.value for m in resumed] == [3.0], "the restarted workers must resume from the step-3 checkpoint"
    loss_steps = Counter(m.step for m in client.get_metric_history(result.run_id, "loss"))
    assert sorted(loss_steps) == list(range(1, MAX_STEPS + 1)), "every step up to max_steps is logged"
    assert all(loss_steps[step] == 1 for step in (1, 2, 3)), "steps before the checkpoint were trained again"
    train_shards = HiddenStateShards(hidden_dir / "train")
    expected = expected_tokens_seen(train_shards, MAX_STEPS, cfg.train.num_workers, cfg.train.micro_batch_size, cfg.seed)
    tokens_seen = [m.value for m in client.get_metric_history(result.run_id, "tokens_seen") if m.step == MAX_STEPS]
    assert tokens_seen[-1] == expected, "the data position did not continue from the checkpoint"
    assert result.best_step in (3, 6, 8)
    assert (result.export_dir / "config.json").is_file() and result.model_version
    resumed_s = resumed[0].timestamp / 1000 - held.kill.killed_at_unix
    print(f"train: {held.kill.name} killed while a rank held at step {HOLD_AT_STEP}; resumed at step 3 {resumed_s:.1f} s "
          f"after the kill, finished {finished - held.kill.killed_at_monotonic:.1f} s after it; best step "
          f"{result.best_step}, version {result.model_version}")


LOAD_CLIENTS = 4
BODY = {"messages": [{"role": "user", "content": "Name a Python builtin."}], "max_tokens": 8, "temperature": 0}


def _serve_replicas() -> dict[str, list[str]]:
    """Serve's running replicas per deployment: deployment name -> node ids."""
    from draftline.serving.control import _deployed_app

    deployments = (_deployed_app() or {}).get("deployments", {})
    return {name: [r["node_id"] for r in d.get("replicas", []) if r.get("state") == "RUNNING"]
            for name, d in deployments.items()}


def test_serving_with_two_replicas_survives_losing_the_node_of_one(multinode, tiny_target_dir, tmp_path):
    """The proxy runs on the head only: every node here has the address 127.0.0.1, so proxies on every node (Serve's
    default) would compete for one port; on a real cluster each node has its own address."""
    from ray import serve

    from draftline.registry import promote
    from draftline.serving.control import serve_champion
    from draftline.serving.engine_server import ENGINE_DEPLOYMENT
    from draftline.tracking import GATE_TAG
    from registry_helpers import mlflow_test_config, random_drafter, register_drafter
    from serve_helpers import run_load

    cfg = mlflow_test_config(tmp_path, [f"serve.port={free_port()}", "serve.num_replicas=2", "serve.cpus_per_replica=1"])
    promote(cfg, register_drafter(cfg, random_drafter(tiny_target_dir, seed=1), {GATE_TAG: "passed"}))
    serve.start(proxy_location="HeadOnly", http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    url = serve_champion(cfg)
    replicas = _serve_replicas()
    engine_nodes = {multinode.name_of(n) for n in replicas[ENGINE_DEPLOYMENT]}
    ingress_nodes = {multinode.name_of(n) for name, nodes in replicas.items() if name != ENGINE_DEPLOYMENT for n in nodes}
    assert len(engine_nodes) == 2, f"the two engine replicas share a node: {replicas}"
    victim = next(name for name in sorted(engine_nodes) if name != HEAD and name not in ingress_nodes)

    load_s, kill_after_s = 40.0, 8.0
    outcome: dict = {}
    load = threading.Thread(target=lambda: outcome.update(
        result=asyncio.run(run_load(f"{url}/v1/chat/completions", BODY, LOAD_CLIENTS, load_s))))
    load.start()
    time.sleep(kill_after_s)
    kill = multinode.kill_node(victim)
    load.join(timeout=load_s + 120)
    serve.shutdown()
    result = outcome["result"]

    killed_at = kill.killed_at_monotonic
    in_flight = [t for t in result.timeline if t[0] <= killed_at < t[1]]
    after = sorted((t for t in result.timeline if t[0] > killed_at), key=lambda t: t[0])
    failed = [t for t in result.timeline if t[2] is not None]
    first_ok_after = next(t for t in after if t[2] is None)
    longest_s = max(t[1] - t[0] for t in result.timeline if t[1] >= killed_at)
    before = [t[1] - t[0] for t in result.timeline if t[1] < killed_at]
    print(f"serve: {len(result.timeline)} requests from {LOAD_CLIENTS} clients, {len(failed)} failed "
          f"({Counter(t[2][:60] for t in failed)}); {len(in_flight)} in flight when {victim} "
          f"({kill.processes} processes) died; first request started after the kill answered in "
          f"{first_ok_after[1] - first_ok_after[0]:.2f} s; longest request around the kill {longest_s:.2f} s "
          f"(median before {sorted(before)[len(before) // 2]:.2f} s)")
    assert result.ok > 0 and before and after
    assert all(t[2] is None for t in after[len(after) // 2:]), "requests still fail long after the node died"
    # Without the ingress resending a request whose replica died before answering (branch rollout, issue 18 fault 5;
    # with it this becomes failed == []), requests that were sent to the killed replica fail, in OpenAI's error
    # shape: 503 engine_failed when it died mid-generation, and (seen once in two runs) 500 internal_error naming
    # ActorUnavailableError when it died before the first chunk. None of the later ones may fail.
    assert all(t[0] <= killed_at + 30 for t in failed), failed
    assert all(json.loads(t[2].split(": ", 1)[1])["error"]["code"] for t in failed), failed
