"""The local Ray cluster draftline starts (see draftline.raycluster): its servers listen on loopback only, and token
auth stays on with a per-process token (other local users reach loopback too). Real cluster, real processes."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time

import pytest

from draftline.raycluster import LOCAL_ONLY_ENV


CONNECT = "import ray, sys; ray.init(address=sys.argv[1]); print('CONNECTED', ray.cluster_resources().get('CPU'))"


def _connect(address: str, env: dict) -> subprocess.CompletedProcess:
    """A plain Ray client: it reaches the loopback-only local cluster with Ray's local-only switch (raycluster)."""
    return subprocess.run([sys.executable, "-c", CONNECT, address], env={**env, LOCAL_ONLY_ENV: "0"},
                          capture_output=True, text=True, timeout=120)


def test_local_cluster_refuses_a_client_without_its_token(ray_cluster):
    import ray

    if os.environ.get("RAY_AUTH_MODE") != "token":
        pytest.skip(f"RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE')} was set before this test run")
    address = ray._private.worker.global_worker.node.gcs_address
    with_token = _connect(address, dict(os.environ))
    assert with_token.returncode == 0 and "CONNECTED" in with_token.stdout, with_token.stderr[-2000:]

    without = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    refused = _connect(address, without)
    assert refused.returncode != 0 and "CONNECTED" not in refused.stdout
    assert "AuthenticationError" in refused.stderr, refused.stderr[-2000:]

    wrong = _connect(address, {**os.environ, "RAY_AUTH_TOKEN": "0" * 64})
    assert wrong.returncode != 0 and "CONNECTED" not in wrong.stdout


def test_local_cluster_listens_on_loopback_only(ray_cluster):
    """Fault 12: Ray's metrics export port (and the dashboard agent, GCS, raylet and workers) listened on every
    interface without auth; the runtime-env agent on the machine's address."""
    import psutil
    import ray

    if not psutil.net_connections(kind="tcp"):
        pytest.skip("cannot see this machine's sockets")
    (node,) = ray.nodes()
    cluster_pids = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
    listening = [(c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.pid in cluster_pids]
    assert ("127.0.0.1", node["MetricsExportPort"]) in listening
    assert node["NodeManagerAddress"] == "127.0.0.1"

    def loopback(ip: str) -> bool:
        address = ipaddress.ip_address(ip)
        return (getattr(address, "ipv4_mapped", None) or address).is_loopback

    assert len(listening) >= 8, listening  # GCS, raylet, agents, dashboard, workers: the test sees them all
    assert [a for a in listening if not loopback(a[0])] == []


@pytest.mark.parametrize(
    "preset, expected",
    [
        ({}, {"RAY_AUTH_MODE": "token", "token_len": 64}),
        ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_MODE": "disabled", "token_len": 0}),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "mine"}, {"RAY_AUTH_MODE": "token", "token_len": 4}),
    ],
)
def test_auth_choice_respects_what_the_user_set(preset, expected):
    """Run in a fresh process: the choice re-initialises Ray's config, which must not touch this test session's."""
    code = ("import os, json; from draftline.raycluster import local_auth_env; local_auth_env(); "
            "print(json.dumps({'RAY_AUTH_MODE': os.environ.get('RAY_AUTH_MODE'), "
            "'token_len': len(os.environ.get('RAY_AUTH_TOKEN', ''))}))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, **preset}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected


STATE_API_IN_A_TASK = """
import sys, time, ray
from draftline.raycluster import ensure_ray
ensure_ray(num_cpus=1)

@ray.remote(num_cpus=0)
def nodes_seen_by_the_state_api():
    # What Ray Train's placement-group cleaner does: the state API with no address, from inside the cluster.
    from ray.util.state import list_nodes
    return sorted(n.node_id for n in list_nodes())

@ray.remote(num_cpus=0)
def api_token_in_worker():
    import os
    return os.environ.get("DRAFTLINE_API_TOKEN")

own = ray.get_runtime_context().get_node_id()
print("SEEN", ray.get(nodes_seen_by_the_state_api.remote()) == [own], flush=True)
print("WORKER TOKEN", ray.get(api_token_in_worker.remote()), flush=True)
"""


def test_local_cluster_state_api_finds_its_own_cluster_beside_another(ray_cluster):
    """Fault 7: with two local Ray instances on the machine, address-less state API calls inside a cluster failed
    with "Found multiple active Ray instances". The test session's cluster is one; a subprocess starts a second."""
    import ray

    other = subprocess.run([sys.executable, "-c", STATE_API_IN_A_TASK], env={**os.environ, "DRAFTLINE_API_TOKEN": "s3cret"},
                           capture_output=True, text=True, timeout=300)
    assert "SEEN True" in other.stdout, other.stderr[-3000:]
    # Fault 12: the raw serving API token was in every Ray worker's environment.
    assert "WORKER TOKEN None" in other.stdout, other.stdout[-2000:]

    @ray.remote(num_cpus=0)
    def nodes_seen_here():
        from ray.util.state import list_nodes
        return sorted(n.node_id for n in list_nodes())

    own = ray.get_runtime_context().get_node_id()
    assert ray.get(nodes_seen_here.remote()) == [own]
    assert "RAY_ADDRESS" not in os.environ, "the pinned address must not leak into the driver's own environment"


# A driver that starts the local cluster as `draftline serve` would, with the serving API token in its environment,
# runs a task and a listening actor (as Serve's HTTP proxy does), then waits until its stdin closes.
LISTENING_DRIVER = """
import json, os, socket, sys, ray
from draftline.raycluster import ensure_ray
ensure_ray(num_cpus=1)

@ray.remote(num_cpus=0)
def worker_pid_and_token():
    return os.getpid(), os.environ.get("DRAFTLINE_API_TOKEN")

@ray.remote(num_cpus=0)
class Listener:
    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()

    def port(self):
        return os.getpid(), self.sock.getsockname()[1]

listener = Listener.remote()
task_pid, task_token = ray.get(worker_pid_and_token.remote())
actor_pid, port = ray.get(listener.port.remote())
print("READY", json.dumps({"task_pid": task_pid, "task_token": task_token, "actor_pid": actor_pid, "port": port}),
      flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def listening_driver():
    """The driver subprocess with its processes (psutil, recursive children: GCS, raylet, agents, dashboard,
    workers) and what it reported once ready."""
    import psutil

    token = "api-" + os.urandom(16).hex()
    driver = subprocess.Popen([sys.executable, "-c", LISTENING_DRIVER], env={**os.environ, "DRAFTLINE_API_TOKEN": token},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    while not (lines and lines[-1].startswith("READY")) and (line := driver.stdout.readline()):
        lines.append(line)
    if not (lines and lines[-1].startswith("READY")):
        driver.kill()
        pytest.fail(f"driver did not start: {''.join(lines)[-2000:]}{driver.stderr.read()[-3000:]}")
    ready = json.loads(lines[-1].split(" ", 1)[1])
    cluster = psutil.Process(driver.pid).children(recursive=True)
    yield driver, token, ready, cluster
    if driver.poll() is None:
        driver.stdin.close()
        driver.wait(timeout=120)


def test_no_process_of_the_local_cluster_holds_the_serving_api_token(listening_driver):
    """Fault 12: the raw serving API token sat in every Ray worker's environment. Read from /proc/<pid>/environ of
    each process of the cluster (what it was started with), the worker that ran a task and the actor included."""
    driver, token, ready, cluster = listening_driver
    pids = {p.pid for p in cluster}
    assert {ready["task_pid"], ready["actor_pid"]} <= pids and len(pids) >= 6, (ready, pids)
    with open(f"/proc/{driver.pid}/environ", "rb") as handle:
        assert token.encode() in handle.read(), "the driver holds the token (it hashes it for the replicas)"
    holding = []
    for process in cluster:
        with open(f"/proc/{process.pid}/environ", "rb") as handle:
            if token.encode() in handle.read():
                holding.append(" ".join(process.cmdline())[:120])
    assert holding == []
    assert ready["task_token"] is None


def test_a_killed_driver_takes_its_local_cluster_along(listening_driver):
    """Fault 7: after SIGKILL of the driver, Ray's dashboard and runtime-env agents stayed up and listening for 61 s
    (they report the raylet's death to the dead GCS first, with a 60 s timeout). draftline's reaper stops them.
    The bound below is generous for a loaded machine and still half of what the agents took without the reaper."""
    import psutil

    driver, _, ready, cluster = listening_driver
    listening_before = {c.pid for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert ready["actor_pid"] in listening_before
    assert len(listening_before & {p.pid for p in cluster}) >= 4  # GCS, raylet, agents, dashboard, the actor

    driver.kill()
    driver.wait()
    def running(process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 30
    while any(running(p) for p in cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    alive = [p for p in cluster if running(p)]
    listening = {c.pid for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert [(p.pid, p.name()) for p in alive if p.pid in listening] == []
    assert [(p.pid, p.name()) for p in alive] == []


SECOND_CLUSTER = """
import time
import ray
from ray.job_submission import JobSubmissionClient
from draftline.raycluster import ensure_ray
ensure_ray(num_cpus=1)
client = JobSubmissionClient(ray.get_runtime_context().gcs_address)
job = client.submit_job(entrypoint="python -c 'print(6 * 7)'")
deadline = time.monotonic() + 180
while not client.get_job_status(job).is_terminal():
    assert time.monotonic() < deadline, f"job {job} still {client.get_job_status(job)} after 180 s"
    time.sleep(1)
print(client.get_job_status(job))
print(client.get_job_logs(job).strip().splitlines()[-1])
"""


def test_a_second_local_cluster_on_the_machine_takes_ray_jobs(ray_cluster):
    """Beside this session's local cluster, another process's `ensure_ray` starts its own and submits a Ray job to it.
    Ray binds every local cluster's dashboard agent to port 52365: the second agent's HTTP server failed to bind, and
    its cluster refused every job ("No available agent to submit job") and exported no metrics."""
    run = subprocess.run([sys.executable, "-c", SECOND_CLUSTER], capture_output=True, text=True, timeout=400,
                         env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.strip().splitlines()[-2:] == ["SUCCEEDED", "42"], run.stdout[-2000:]
