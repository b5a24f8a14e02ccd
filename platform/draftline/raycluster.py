"""Connecting to Ray: a real cluster when RAY_ADDRESS / ray.address is set, else a local one started here.

Token authentication stays on, locally too. On a real cluster draftline never touches it: jobs authenticate with the
cluster's token (RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token) and configs/cluster/ sets
RAY_AUTH_MODE=token. For the local cluster this process starts itself, we considered turning it off, since the node
is given 127.0.0.1 as its address (see _loopback_only_node: with it, measured with `ss -ltnp` on Ray 2.60, every
server of the cluster listens on 127.0.0.1 only; without it the GCS, the raylets, the workers, the dashboard agent
and the metrics export port listened on every interface). But any local user, or any process of this machine, can
still reach 127.0.0.1 and could otherwise run code in the cluster. So, unless the user chose a mode, the local
cluster runs with RAY_AUTH_MODE=token and a fresh random token that lives only in this process's environment
(RAY_AUTH_TOKEN, inherited by Ray's processes and by subprocesses such as the CLI run from tests). It is never
written to ~/.ray/auth_token, so concurrent runs and CI jobs never share or overwrite a per-user token file;
`draftline serve` saves it (mode 0600) beside its state.json so that `draftline promote`/`rollback` from another
shell can roll the running app. RAY_AUTH_MODE=disabled before starting turns it off; RAY_AUTH_MODE=token with your
own RAY_AUTH_TOKEN (or token file) uses yours.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from draftline import reaper
from draftline.config import DraftlineConfig
from draftline.utils import atomic_write_text, environment_restored, free_port


def local_auth_env() -> dict[str, str]:
    """Choose token auth for a local cluster (see the module docstring); returns what was set in os.environ."""
    chosen: dict[str, str] = {}
    if "RAY_AUTH_MODE" not in os.environ:
        chosen["RAY_AUTH_MODE"] = "token"
        if not os.environ.get("RAY_AUTH_TOKEN"):
            chosen["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return _set_auth_env(chosen)


def _set_auth_env(chosen: dict[str, str]) -> dict[str, str]:
    """Put auth settings in os.environ and make this process's Ray see them; returns `chosen`."""
    os.environ.update(chosen)
    if chosen:
        # Ray reads RAY_AUTH_MODE into its config when it is first imported; re-read it, as Ray does itself when
        # it turns token auth on by default (ray._private.authentication.authentication_token_setup).
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    return chosen


def write_local_token(path: Path) -> str | None:
    """Save this process's local-cluster token (mode 0600) for other local processes of the same user, such as
    `draftline promote` rolling a `draftline serve` started in another shell. None when there is no token to save."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    if os.environ.get("RAY_AUTH_MODE") != "token" or not token:
        return None
    return str(atomic_write_text(path, token, mode=0o600))


def adopt_auth(mode: str, token_path: str | None = None) -> None:
    """Connect with the auth settings a local cluster was recorded with, where the user has not set their own."""
    chosen: dict[str, str] = {}
    if mode and "RAY_AUTH_MODE" not in os.environ:
        chosen["RAY_AUTH_MODE"] = mode
    if mode == "token" and token_path and not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        chosen["RAY_AUTH_TOKEN_PATH"] = token_path
    _set_auth_env(chosen)


def ray_job_runtime_env() -> dict:
    """The runtime env this process was submitted with by `ray job submit` ({} when it is not a Ray job)."""
    job_config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    return job_config.get("runtime_env") or {}


def code_runtime_env() -> dict:
    """Ship this process's draftline package to the cluster's workers (Ray `py_modules`).

    `ray job submit --working-dir .` uploads the checkout, but the package lives under platform/, which is not on
    the workers' path; and where the cluster's image has draftline installed, its version may differ from the code
    that the driver runs. py_modules puts the driver's own copy first on every worker's path. Skipped when the job
    was submitted with py_modules of its own: Ray refuses to merge the same field from job and driver.
    """
    if ray_job_runtime_env().get("py_modules"):
        return {}
    return {"py_modules": [os.path.dirname(os.path.abspath(__file__))]}


_ray_mode: str | None = None

# Serve's HTTP proxy imports its middlewares from the callback this variable names, in its own process; every local
# cluster sets it so whichever stage starts the cluster, the serve stage's proxy replays (serving/proxy_replay.py).
SERVE_PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
SERVE_PROXY_CALLBACK = "draftline.serving.proxy_replay.middlewares"


@contextlib.contextmanager
def _environment_for_ray_processes(hidden: tuple[str, ...], pythonpath: str | None = None):
    """Set what Ray's processes must inherit (a pinned address, a PYTHONPATH that finds draftline) and hide what they
    must not (the serving API token, which only the driver needs: replicas get its hash). Ray's processes are forked
    during ray.init and keep that environment; the driver's own is restored afterwards.

    PYTHONPATH goes through the environment, not a job runtime_env: with one, every worker the raylet starts runs
    Ray's setup_worker.py first (a second interpreter start and `import ray`) and then execs the real worker.

    Also set: Serve's proxy callback, so the HTTP proxy sends a request again when its ingress replica died before
    answering (serving/proxy_replay.py); a callback the user set wins."""
    with _pinned_local_address() as address, environment_restored(SERVE_PROXY_CALLBACK_ENV, "PYTHONPATH", *hidden):
        for name in hidden:
            os.environ.pop(name, None)
        os.environ.setdefault(SERVE_PROXY_CALLBACK_ENV, SERVE_PROXY_CALLBACK)
        if pythonpath is not None:
            os.environ["PYTHONPATH"] = pythonpath
        yield address


@contextlib.contextmanager
def _pinned_local_address():
    """Make the local cluster's own processes find it, and only it, whatever other Ray runs on the machine.

    Code inside Ray that calls the state API without an address (Ray Train's placement-group cleaner, via
    `ray.util.state.get_actor`) looks for "the" local cluster: with two on the machine it fails with "Found
    multiple active Ray instances". RAY_ADDRESS in the environment wins over that search, but the GCS port is
    only known once the cluster runs; so pick it first (RAY_GCS_SERVER_PORT) and export both while Ray's
    processes start: they, and every worker the raylet forks, inherit them. The driver's own environment is
    restored afterwards, so subprocesses of this one (a CLI run by a test) still start clusters of their own.
    """
    port = free_port()
    pinned = {"RAY_GCS_SERVER_PORT": str(port), "RAY_ADDRESS": f"127.0.0.1:{port}"}
    with environment_restored(*pinned):
        os.environ.update(pinned)
        yield pinned["RAY_ADDRESS"]


# Ray's own switch between a single-machine Ray and a cluster (named for its default off on Windows and macOS).
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def connect_local_cluster(address: str, **init_kwargs) -> None:
    """ray.init to a local cluster another draftline process started (a `draftline serve`, from another shell).

    It listens on 127.0.0.1 only (_loopback_only_node); a client with Ray's default would turn 127.0.0.1 into the
    machine's address and not reach it, so connect the way it was started. Not for other clusters: a `ray start`
    cluster expects its clients at the machine's address."""
    import ray

    with _loopback_only_node():
        ray.init(address=address, **init_kwargs)


@contextlib.contextmanager
def _loopback_only_node():
    """Give the local cluster's node the loopback address, so Ray's metrics export port, the dashboard agent and
    the runtime-env agent listen on 127.0.0.1 only (issue 18, fault 12).

    Measured with `ss -ltnp` on Ray 2.60: ray.init(_node_ip_address="127.0.0.1") is turned into the machine's
    reachable address (services.resolve_ip_for_localhost), and those servers bind to all interfaces (metrics,
    agent gRPC) or to that address (runtime-env agent) unless the node address is loopback, which Ray chooses only
    when its cluster switch is off. Ray reads that switch from the environment once, at import (ray_constants), and
    this process has imported Ray already: so it is set in both, for ray.init only. Ray's processes, forked during
    ray.init, inherit it and agree on 127.0.0.1. A local cluster has one node, so nothing needs the reachable address.
    """
    from ray._private import ray_constants

    saved_env, saved_constant = os.environ.get(LOCAL_ONLY_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOCAL_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_constant
        if saved_env is None:
            os.environ.pop(LOCAL_ONLY_ENV, None)
        else:
            os.environ[LOCAL_ONLY_ENV] = saved_env


def configured_ray_address(cfg: DraftlineConfig | None = None) -> str | None:
    """ray.address, else RAY_ADDRESS (Ray sets it for `ray job submit` drivers); None: a local Ray started here."""
    return (cfg.ray.address if cfg else None) or os.environ.get("RAY_ADDRESS")


def ensure_ray(cfg: DraftlineConfig | None = None, num_cpus: int | None = None) -> str:
    """Initialise Ray once per process; returns 'cluster' or 'local'."""
    global _ray_mode
    import ray

    if ray.is_initialized():
        return _ray_mode or ("cluster" if os.environ.get("RAY_ADDRESS") else "local")
    address = configured_ray_address(cfg)
    if address:
        ray.init(address=address, runtime_env=code_runtime_env(), log_to_driver=True)
        _ray_mode = "cluster"
        return _ray_mode
    local_auth_env()
    # Workers must import draftline even when it is not pip-installed (e.g. `python jobs/x.py` from a checkout).
    source_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pythonpath = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH", "")) if p)
    api_token_env = (cfg or DraftlineConfig()).serve.auth_token_env
    with _environment_for_ray_processes(hidden=(api_token_env,), pythonpath=pythonpath) as address, _loopback_only_node():
        _init_local(ray, num_cpus or (cfg.ray.num_cpus if cfg else None))
    _start_reaper(address)
    _ray_mode = "local"
    return _ray_mode


@contextlib.contextmanager
def local_ray_stopped_at_the_end() -> Iterator[None]:
    """Stop, as the block ends, a local cluster this process started inside it. Ray prints the last lines its workers
    wrote as it shuts down; at interpreter exit they would reach the terminal after the command's log has closed.
    A cluster that was up before the block (a test session's) or that is not local is left alone."""
    global _ray_mode
    up_before = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    try:
        yield
    finally:
        if not up_before and _ray_mode == "local" and "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
            _ray_mode = None


_reaper: subprocess.Popen | None = None  # kept for this process's life: its stdin is the pipe the reaper watches


def _start_reaper(address: str) -> None:
    """Stop the local cluster at `address` when this process exits, even by SIGKILL (see draftline/reaper.py).
    Started after ray.init, so Ray's processes do not inherit the pipe's write end."""
    global _reaper
    _reaper = reaper.spawn("cluster", address.rsplit(":", 1)[1])


@contextlib.contextmanager
def _own_dashboard_agent_port(ray) -> Iterator[None]:
    """A free port for the local cluster's dashboard agent. Ray binds it to 52365 whatever else runs, and ray.init
    has no parameter for it: a second local cluster on the machine (another user's `draftline run`, a second test
    worker) gets an agent whose HTTP server failed to bind, so its cluster takes no Ray job ("No available agent to
    submit job") and exports no metrics. RayParams, which ray.init builds, takes the port."""
    params_module = ray._private.parameter
    original = params_module.RayParams
    port = free_port()

    class RayParamsWithAgentPort(original):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("dashboard_agent_listen_port", port)
            super().__init__(*args, **kwargs)

    params_module.RayParams = RayParamsWithAgentPort
    try:
        yield
    finally:
        params_module.RayParams = original


def _init_local(ray, num_cpus: int | None) -> None:
    with _own_dashboard_agent_port(ray):
        _init_local_cluster(ray, num_cpus)


def _init_local_cluster(ray, num_cpus: int | None) -> None:
    ray.init(
        address="local",
        num_cpus=num_cpus,
        # The dashboard serves Ray's state API, which Ray Train polls; its HTTP server binds to loopback.
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        _node_ip_address="127.0.0.1",
        # The token and PYTHONPATH reach Ray's processes through the inherited environment, not a runtime env
        # (_environment_for_ray_processes).
        log_to_driver=True,
    )
