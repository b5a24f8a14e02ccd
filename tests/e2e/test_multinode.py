"""Multi-node on this machine (issue 18): a head and two worker nodes, each its own Ray process tree on 127.0.0.1 with
token auth (tests/multinode_helpers.py). Extraction and training run as Ray Train groups spread over the nodes; a
whole worker node is SIGKILLed mid-extraction and mid-training, and the node of one of two serving replicas under
load. Real Ray, DeepSpeed, MLflow and HTTP.

A worker of the group holds at the fault hook (draftline.faults, action "hold") so the node dies at a known point:
after a known number of shards, after a known committed checkpoint. Each node has 1 CPU and a group has 2 workers,
so the two workers run on two different nodes and the restarted group fits on the two that survive.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from draftline.data.prepare import load_split
from draftline import faults
from draftline.extract.run import extract_with_stats
from draftline.extract.shards import HiddenStateShards, num_shards
from draftline.train.run import train
from draftline.utils import free_port
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

# One cluster for the module (11 s to start at load ~4); each scenario kills one worker node and the next one
# gets a fresh worker node in its place.
pytestmark = pytest.mark.timeout(1200)

WORKER_NODES = 2


@pytest.fixture(scope="module")
def multinode_cluster():
    """A head + 2 worker nodes for the module; the session's local Ray, if this process was connected to it, is shut
    down first (one cluster of ours at a time) and started again afterwards."""
    import ray
    from ray import serve

    was_connected = ray.is_initialized()
    if was_connected:
        serve.shutdown()
        ray.shutdown()
    cluster = start_multinode_cluster(worker_nodes=WORKER_NODES, num_cpus=1, head_cpus=1)
    try:
        yield cluster
    finally:
        cluster.shutdown()
        if was_connected:
            start_session_ray()


@pytest.fixture
def multinode(multinode_cluster):
    """The module's cluster with a head and 2 live worker nodes: the node a scenario killed is marked dead by Ray and
    replaced by a fresh one; yields the cluster and the Ray Train worker actors that ran before this scenario."""
    cluster = multinode_cluster
    cluster.wait_until_dead()
    while len(cluster.nodes) < 1 + WORKER_NODES:
        print(f"started {cluster.add_worker_node()} in place of {cluster.kills[-1].name}")
    live = {name: cluster.node_ids[name] for name in cluster.nodes}
    assert node_of_each_node_resource(cluster) == live, "a task pinned to a node ran elsewhere"
    yield cluster, {a.actor_id for a in train_worker_actors(detail=False)}


def _check_spread_and_restart(cluster, held, earlier: set, label: str) -> None:
    """The group ran on two nodes when one died; a new group ran on surviving nodes (`earlier`: worker actors of
    the scenarios before this one). Under load Ray may place a restarted worker on the killed node before its
    missed heartbeats mark the node dead (seen at load ~30): that worker must be dead by the end, either with the
    node or killed by Ray Train when it tore that group down (RAY_KILL, seen in CI), and the run went on through
    another restart (train.max_failures) on the survivors."""
    dead = held.kill.name
    assert len(set(held.workers_at_kill.values())) == 2, f"{label}: workers were not spread: {held.workers_at_kill}"
    assert dead in held.workers_at_kill.values(), f"{label}: the killed node {dead} ran none of the group's workers"
    restarted = [a for a in train_worker_actors()
                 if a.actor_id not in held.workers_at_kill and a.actor_id not in earlier]
    on_survivors = sorted(cluster.name_of(a.node_id) for a in restarted if cluster.name_of(a.node_id) != dead)
    assert len(on_survivors) >= 2, f"{label}: Ray Train did not start a new worker group on the surviving nodes: {on_survivors}"
    for actor in restarted:
        if cluster.name_of(actor.node_id) == dead:
            cause = json.dumps(actor.death_cause or {})
            assert actor.state == "DEAD" and any(
                mark in cause for mark in ("NODE_DIED", held.kill.node_id, "RAY_KILL")), (
                f"{label}: a restarted worker on the dead node {dead} is {actor.state}, not dead with the node "
                f"or its torn-down group: {cause}")
    print(f"{label}: workers on {sorted(held.workers_at_kill.values())} when {dead} was killed "
          f"({held.kill.processes} processes); restarted on {on_survivors}")


SHARDS_BEFORE_HOLD = 2


def test_extraction_finishes_after_a_worker_node_dies(multinode, tiny_dataset_dir, tmp_path, monkeypatch):
    cluster, earlier = multinode
    marker = tmp_path / "worker-held"
    monkeypatch.setenv(faults.ENV, faults.encode(faults.Fault("extract.shards", SHARDS_BEFORE_HOLD, str(marker), "hold")))
    hidden = tmp_path / "hidden"
    cfg = make_test_config(extra=[
        f"extract.storage_uri={hidden}", "extract.num_workers=2", "extract.samples_per_shard=8",
        "extract.max_failures=2",
    ])
    samples = load_split(tiny_dataset_dir, "train")
    total_shards = num_shards(len(samples), 8)
    killer = kill_node_of_held_worker(cluster, marker, count_records=lambda: len(list(hidden.glob("*/train/shard-*.json"))))
    started = time.monotonic()
    result = extract_with_stats(cfg, tiny_dataset_dir, split="train")
    finished = time.monotonic()
    held = joined(killer)

    assert held.kill.node_id not in cluster.alive_node_ids()
    assert SHARDS_BEFORE_HOLD <= held.shard_records_at_kill < total_shards, "the node died before or after the run"
    _check_spread_and_restart(cluster, held, earlier, "extract")

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


MAX_STEPS = 5
HOLD_AT_STEP = 4  # at the start of step 4: after the step-3 checkpoint is committed (train.checkpoint_every=3)


def test_training_resumes_on_the_surviving_nodes(multinode, tiny_cfg, tiny_target_dir, tiny_dataset_dir, tmp_path,
                                                  monkeypatch):
    from mlflow import MlflowClient

    from tests.e2e.test_train_fault import expected_tokens_seen

    cluster, earlier = multinode
    hidden_dir = hidden_states_of_test_target(tiny_cfg, tiny_dataset_dir)  # cached by hash after the first run
    marker = tmp_path / "rank-held"
    monkeypatch.setenv(faults.ENV, faults.encode(faults.Fault("train.step", HOLD_AT_STEP, str(marker), "hold")))
    cfg = short_run_config(tmp_path, [f"train.max_steps={MAX_STEPS}", "train.max_failures=2"])
    killer = kill_node_of_held_worker(cluster, marker)
    result = train(cfg, hidden_dir, tiny_dataset_dir, tiny_target_dir)
    finished = time.monotonic()
    held = joined(killer)

    _check_spread_and_restart(cluster, held, earlier, "train")
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
    assert result.best_step in (3, MAX_STEPS)
    assert (result.export_dir / "config.json").is_file() and result.model_version
    resumed_s = resumed[0].timestamp / 1000 - held.kill.killed_at_unix
    print(f"train: {held.kill.name} killed while a rank held at step {HOLD_AT_STEP}; resumed at step 3 {resumed_s:.1f} s "
          f"after the kill, finished {finished - held.kill.killed_at_monotonic:.1f} s after it; best step "
          f"{result.best_step}, version {result.model_version}; loss logged per step {dict(sorted(loss_steps.items()))}")


LOAD_CLIENTS = 4
LOAD_ANSWERS_BEFORE_KILL = 2 * LOAD_CLIENTS
# Load goes on until Ray has marked the killed node dead (the replica's actor dead with it) and this long after.
LOAD_AFTER_DEAD_S = 5.0


def _serve_replicas() -> dict[str, list[str]]:
    """Serve's running replicas per deployment: deployment name -> node ids."""
    from draftline.serving.control import _deployed_app

    deployments = (_deployed_app() or {}).get("deployments", {})
    return {name: [r["node_id"] for r in d.get("replicas", []) if r.get("state") == "RUNNING"]
            for name, d in deployments.items()}


def test_serving_with_two_replicas_survives_losing_the_node_of_one(multinode, tiny_target_dir, tmp_path):
    """The proxy runs on the head only: every node here has the address 127.0.0.1, so proxies on every node (Serve's
    default) would compete for one port; on a real cluster each node has its own address. With 1 CPU per node the
    two engine replicas (1 CPU each) fill two nodes and the ingress replicas the third, so Serve has no room for a
    replacement engine replica: the survivor serves alone."""
    from ray import serve

    from draftline.registry import promote
    from draftline.serving.engine_server import ENGINE_DEPLOYMENT
    from draftline.tracking import GATE_TAG
    from registry_helpers import mlflow_test_config, random_drafter, register_drafter
    from serve_helpers import start_serving, under_load, wait_for_answers

    cluster, _ = multinode
    cfg = mlflow_test_config(tmp_path, [f"serve.port={free_port()}", "serve.num_replicas=2", "serve.cpus_per_replica=1",
                                        "serve.proxy_location=HeadOnly"])
    promote(cfg, register_drafter(cfg, random_drafter(tiny_target_dir, seed=1), {GATE_TAG: "passed"}))
    try:
        url = start_serving(cfg)  # the path of `draftline serve`
        replicas = _serve_replicas()
        engine_nodes = {cluster.name_of(n) for n in replicas[ENGINE_DEPLOYMENT]}
        ingress_nodes = {cluster.name_of(n) for name, nodes in replicas.items() if name != ENGINE_DEPLOYMENT
                         for n in nodes}
        assert len(engine_nodes) == 2, f"the two engine replicas share a node: {replicas}"
        # A worker node with an engine replica, one without an ingress replica if there is one.
        victim = min((name for name in engine_nodes if name != HEAD), key=lambda name: (name in ingress_nodes, name))
        with under_load(url, max_s=300, clients=LOAD_CLIENTS) as results:
            wait_for_answers(results, LOAD_ANSWERS_BEFORE_KILL)
            kill = cluster.kill_node(victim)
            cluster.wait_until_dead()
            dead_after_s = time.monotonic() - kill.killed_at_monotonic
            time.sleep(LOAD_AFTER_DEAD_S)
    finally:
        serve.shutdown()

    results = list(results)
    killed_at = kill.killed_at_monotonic
    in_flight = [r for r in results if r[0] <= killed_at < r[1]]
    after = sorted((r for r in results if r[0] > killed_at), key=lambda r: r[0])
    failed = [r for r in results if isinstance(r[2], Exception)]
    first_ok_after = next(r for r in after if not isinstance(r[2], Exception))
    longest_s = max(r[1] - r[0] for r in results if r[1] >= killed_at)
    before = [r[1] - r[0] for r in results if r[1] < killed_at]
    print(f"serve: {len(results)} requests from {LOAD_CLIENTS} clients, {len(failed)} failed "
          f"({Counter(str(r[2])[:120] for r in failed)}); {len(in_flight)} in flight when {victim} "
          f"({kill.processes} processes, ingress replica on it: {victim in ingress_nodes}) died; Ray marked it dead "
          f"{dead_after_s:.1f} s after; first request started after the kill answered in "
          f"{first_ok_after[1] - first_ok_after[0]:.2f} s; longest request around the kill {longest_s:.2f} s "
          f"(median before {sorted(before)[len(before) // 2]:.2f} s)")
    assert before and after
    assert all(not isinstance(r[2], Exception) for r in after[len(after) // 2:]), "requests still fail after the kill"
    assert all(r[2].openai_shaped for r in failed), failed
    assert all(r[0] <= killed_at + dead_after_s for r in failed), "a request sent after Ray marked the node dead failed"
