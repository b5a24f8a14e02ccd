"""A Ray cluster of several nodes on this machine, for the multi-node fault tests (tests/e2e/test_multinode.py).

Every node is Ray's own process tree, started by `ray.cluster_utils.Cluster`: the head (GCS, dashboard, raylet,
object store, agents) and each worker node (raylet, object store, agents; the workers its raylet forks). All of them
listen on 127.0.0.1 and run with the token auth of draftline's local cluster (draftline.raycluster: RAY_AUTH_MODE=token
and a fresh token in the environment Ray's processes inherit), with the GCS address pinned in their RAY_ADDRESS so
code inside the cluster never finds another Ray of this machine instead. Each node has `num_cpus` CPUs and a custom
resource `node-<name>` (1 unit), so a task can be pinned to a node by name.

`kill_node` is a machine dying: SIGKILL, at once, to every process of the node (its raylet, agents, object store and
every worker process the raylet forked) and no graceful shutdown. Work on the other nodes goes on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field

HEAD = "head"

# The GCS checks each raylet's health every 3 s by default and marks its node dead after 5 failed checks in a row.
# A killed node's port refuses at once, so every 1 s here: Ray marks it dead ~5 s after the kill instead of ~15 s.
# Each check still waits Ray's default 10 s: a live raylet slowed by load is marked dead only after ~55 s unanswered.
NODE_HEALTH_CHECK = {"health_check_period_ms": 1000}


@dataclass
class NodeKill:
    """What kill_node did: which node, when (time.monotonic and wall clock), and how many processes it killed."""

    name: str
    node_id: str
    killed_at_monotonic: float
    killed_at_unix: float
    processes: int


@dataclass
class MultiNodeCluster:
    """A head and worker nodes on 127.0.0.1; `node_ids[name]` is the Ray node id of each."""

    cluster: object
    nodes: dict = field(default_factory=dict)  # name -> ray._private.node.Node
    node_ids: dict = field(default_factory=dict)  # name -> Ray node id (hex)
    kills: list = field(default_factory=list)
    num_cpus: int = 1
    # What every node's processes inherit (the pinned GCS address, Serve's proxy callback), kept for nodes added later.
    node_env: dict = field(default_factory=dict)
    hidden_env: tuple = ()  # what they must not inherit (the serving API token)
    added: int = 0  # worker nodes ever added: the next one is worker<added + 1>

    @property
    def address(self) -> str:
        return self.cluster.address

    def name_of(self, node_id: str) -> str:
        return next(name for name, known in self.node_ids.items() if known == node_id)

    def processes_of(self, name: str) -> list:
        """Every live process of the node: the ones Ray started for it and everything they forked (the workers)."""
        import psutil

        roots = [info.process.pid for infos in self.nodes[name].all_processes.values() for info in infos]
        found: dict[int, psutil.Process] = {}
        for pid in roots:
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(pid)
                for process in [root, *root.children(recursive=True)]:
                    found[process.pid] = process
        return list(found.values())

    def kill_node(self, name: str) -> NodeKill:
        """SIGKILL every process of worker node `name` at once (the head holds the GCS and the driver: never it)."""
        import psutil

        if name == HEAD:
            raise ValueError("kill_node kills worker nodes; the head holds the GCS and the test's driver")
        processes = self.processes_of(name)
        killed_at_monotonic, killed_at_unix = time.monotonic(), time.time()
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        psutil.wait_procs(processes, timeout=30)
        node = self.nodes.pop(name)
        # Ray's bookkeeping only: every process is already dead, so nothing is shut down gracefully.
        self.cluster.remove_node(node, allow_graceful=False)
        kill = NodeKill(name, self.node_ids[name], killed_at_monotonic, killed_at_unix, len(processes))
        self.kills.append(kill)
        return kill

    @contextlib.contextmanager
    def _node_environment(self):
        from draftline.raycluster import _loopback_only_node
        from draftline.utils import environment_restored

        with environment_restored(*self.node_env, *self.hidden_env):
            for name in self.hidden_env:
                os.environ.pop(name, None)
            os.environ.update(self.node_env)
            with _loopback_only_node():
                yield

    def add_worker_node(self, **extra) -> str:
        """Start a fresh worker node (the next name: worker3 after worker1 and worker2) and wait until it is up."""
        self.added += 1
        name = f"worker{self.added}"
        with self._node_environment():
            node = self.cluster.add_node(num_cpus=self.num_cpus, resources={f"node-{name}": 1},
                                         node_ip_address="127.0.0.1", **extra)
        self.nodes[name] = node
        self.node_ids[name] = node.node_id
        self.cluster.wait_for_nodes()
        return name

    def wait_until_dead(self, timeout_s: float = 120) -> None:
        """Poll until Ray marks every killed node dead (NODE_HEALTH_CHECK)."""
        killed = {kill.node_id for kill in self.kills}
        deadline = time.monotonic() + timeout_s
        while killed & self.alive_node_ids():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray still lists killed nodes as alive after {timeout_s:.0f} s")
            time.sleep(0.5)

    def alive_node_ids(self) -> set[str]:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def shutdown(self) -> None:
        import psutil

        import ray

        ray.shutdown()
        leftovers = [p for name in list(self.nodes) for p in self.processes_of(name)]
        self.cluster.shutdown()
        for process in leftovers:  # workers that outlive their raylet for a moment
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        psutil.wait_procs(leftovers, timeout=30)
        self.nodes.clear()


def start_multinode_cluster(worker_nodes: int = 2, num_cpus: int = 1, head_cpus: int = 1) -> MultiNodeCluster:
    """Start a head and `worker_nodes` worker nodes (names head, worker1, ...), connect this process to the head as
    a driver that ships its draftline source to every node (Ray py_modules, as for a real cluster), and return it."""
    from ray.cluster_utils import Cluster

    import ray
    from draftline.config import DraftlineConfig
    from draftline.raycluster import (
        _environment_for_ray_processes,
        code_runtime_env,
        connect_local_cluster,
        local_auth_env,
    )
    from draftline.raycluster import SERVE_PROXY_CALLBACK_ENV
    from draftline.utils import free_port

    if ray.is_initialized():
        raise RuntimeError("this process is already connected to a Ray cluster; shut it down first")
    local_auth_env()
    # shutdown_at_exit=False: no reaper, which would make this test process a process-group leader; the fixture
    # shuts the cluster down.
    cluster = Cluster(shutdown_at_exit=False)
    multi = MultiNodeCluster(cluster, num_cpus=num_cpus)
    try:
        # As draftline's local cluster (raycluster.ensure_ray): a pinned GCS address, Serve's proxy callback
        # (serving/proxy_replay.py) and no serving API token in Ray's processes.
        multi.hidden_env = (DraftlineConfig().serve.auth_token_env,)
        with _environment_for_ray_processes(hidden=multi.hidden_env):
            multi.node_env = {name: os.environ[name] for name in ("RAY_GCS_SERVER_PORT", "RAY_ADDRESS", SERVE_PROXY_CALLBACK_ENV)}
        with multi._node_environment():
            # The head's other fixed default ports (dashboard 8265, agent 52365) may be another Ray's on this machine.
            node = cluster.add_node(num_cpus=head_cpus, resources={f"node-{HEAD}": 1}, node_ip_address="127.0.0.1",
                                    gcs_server_port=int(multi.node_env["RAY_GCS_SERVER_PORT"]), include_dashboard=True,
                                    dashboard_host="127.0.0.1", dashboard_port=free_port(),
                                    dashboard_agent_listen_port=None, _system_config=NODE_HEALTH_CHECK)
        multi.nodes[HEAD] = node
        multi.node_ids[HEAD] = node.node_id
        for _ in range(worker_nodes):
            multi.add_worker_node()
        connect_local_cluster(cluster.address, runtime_env=code_runtime_env(), log_to_driver=True)
    except BaseException:
        multi.shutdown()
        raise
    return multi


def node_of_each_node_resource(multi: MultiNodeCluster) -> dict[str, str]:
    """Run a task pinned to each live node by its custom resource; name -> the node id it ran on."""
    import ray

    @ray.remote(num_cpus=0)
    def where() -> str:
        return ray.get_runtime_context().get_node_id()

    names = list(multi.nodes)
    found = ray.get([where.options(resources={f"node-{name}": 0.01}).remote() for name in names], timeout=120)
    return dict(zip(names, found))


def train_worker_actors(detail: bool = True) -> list:
    """Ray Train's worker actors (extraction and training both run as Ray Train worker groups), dead ones too."""
    import ray
    from ray.util.state import list_actors

    return list_actors(address=ray.get_runtime_context().gcs_address, limit=10_000, detail=detail,
                       filters=[("class_name", "=", "RayTrainWorker")], raise_on_missing_output=False)


@dataclass
class HeldWorkerKill:
    """A worker node killed while a worker of a Ray Train group held at a fault hook (draftline.faults, action "hold")."""

    kill: NodeKill
    held_on: str  # the node the holding worker ran on
    workers_at_kill: dict  # actor id -> node name, the group's live workers when the node died
    shard_records_at_kill: int = 0


def kill_node_of_held_worker(multi: MultiNodeCluster, marker, timeout_s: float = 600, count_records=None) -> dict:
    """In a thread: once a worker writes "... on node <id>" into `marker` (it then waits), SIGKILL its node, or when it
    runs on the head, the node of another live worker of the group. Returns a dict that gets "kill"
    (HeldWorkerKill) or "error"; join its "thread" after the stage returned."""
    import threading
    from pathlib import Path

    outcome: dict = {}

    def run() -> None:
        try:
            deadline = time.monotonic() + timeout_s
            held = None
            while held is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no worker held at the fault hook within {timeout_s:.0f} s ({marker})")
                text = Path(marker).read_text() if Path(marker).exists() else ""
                lines = [line for line in text.splitlines() if " on node " in line]
                held = lines[0].rsplit(" on node ", 1)[1].strip() if lines else None
                time.sleep(0.2)
            workers = {a.actor_id: multi.name_of(a.node_id) for a in train_worker_actors() if a.state == "ALIVE"}
            held_on = multi.name_of(held)
            victim = held_on if held_on != HEAD else next(name for name in workers.values() if name != HEAD)
            records = count_records() if count_records else 0
            outcome["kill"] = HeldWorkerKill(multi.kill_node(victim), held_on, workers, records)
        except BaseException as err:  # noqa: BLE001 - reported to the test's thread
            outcome["error"] = err

    outcome["thread"] = threading.Thread(target=run, daemon=True)
    outcome["thread"].start()
    return outcome


def joined(outcome: dict) -> HeldWorkerKill:
    outcome["thread"].join(timeout=120)
    if "error" in outcome:
        raise outcome["error"]
    assert "kill" in outcome, "the node killer did not finish"
    return outcome["kill"]
