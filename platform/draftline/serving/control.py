"""Starting Serve, finding what it serves, and rolling it to a given version.

- `serve_champion(cfg)`: start Serve on serve.host/port and deploy the app *declaratively* (the path of
  `serve deploy`): import path `draftline.serving.app:app_builder`, args = the resolved config (credentials
  redacted), the served version and the API token's sha256, and the
  engine deployment's `user_config` = the champion. Writes `<data_dir>/serve/port-<serve.port>/state.json` so other processes
  (`draftline promote`, `draftline serve --roll`) can find the cluster.
- `serving_now(cfg)`: the version a running app serves (None when nothing serves for this data dir).
- `roll_to(cfg, served)`: re-apply the deployed app config with only the engine's user_config changed. Serve sees
  a user_config-only change and reconfigures the replicas in place; how a replica swaps engines is the rollout
  strategy (serve.rollout beside / drain_and_swap, see engine_server.py). An app deployed imperatively
  (`serve run serve.app:app`) has no stored config: it is redeployed with `serve.run`, which replaces replicas.
- serve.rollout=blue_green: the engine replicas are a Serve app of their own (one of app.ENGINE_APPS) and the
  ingress's user_config names it. `roll_to` deploys the other one with the new version on spare capacity, waits
  until every replica of it serves that version, switches the ingress (an in-place reconfigure), then deletes the
  old set, whose replicas finish their requests first (graceful_shutdown_timeout_s = serve.drain_timeout_s). A new
  set that fails is deleted; the old one never stopped serving.
The registry never calls this module: draftline.release rolls serving first and moves the alias after.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any, Optional

from draftline.config import DraftlineConfig, shown_config
from draftline.raycluster import adopt_auth, connect_local_cluster, ensure_ray, write_local_token
from draftline.serving.app import APP_NAME, ENGINE_APPS, auth_token_sha256_from_env, build_app
from draftline.serving.engine_server import ENGINE_DEPLOYMENT
from draftline.serving.openai_api import INGRESS_DEPLOYMENT
from draftline.serving.served_model import ServedModel, resolve_served_model
from draftline.serving.traffic_capture import CAPTURE_DEPLOYMENT
from draftline.utils import atomic_write_json, read_json

logger = logging.getLogger(__name__)

APP_BUILDER_IMPORT_PATH = "draftline.serving.app:app_builder"
ENGINE_APP_BUILDER_IMPORT_PATH = "draftline.serving.app:engine_app_builder"


class ServingError(RuntimeError):
    """Serve is not running where expected, or a rollout did not converge; phrased for the user."""


def serve_state_dir(cfg: DraftlineConfig) -> Path:
    """Where the app serving on cfg.serve.port records itself: one directory per port, so that two apps from one
    data dir (two configs, or two test processes) do not overwrite each other's record, and `draftline promote`
    with a config reaches the app on that config's port."""
    return cfg.data_path("serve", f"port-{cfg.serve.port}")


def state_path(cfg: DraftlineConfig) -> Path:
    return serve_state_dir(cfg) / "state.json"


def serving_record(cfg: DraftlineConfig) -> Optional[tuple[Path, dict]]:
    """(path, contents) of the record of the app serving on cfg.serve.port, None when there is none. An app started
    by a draftline older than the per-port records wrote one record per data dir (`<data_dir>/serve/state.json`);
    it is that app's record when its base_url is on this port, so that `promote`/`rollback` after an upgrade still
    roll an app that was serving before it."""
    path = state_path(cfg)
    if path.exists():
        return path, read_json(path)
    legacy = cfg.data_path("serve", "state.json")
    if legacy.exists():
        state = read_json(legacy)
        if urllib.parse.urlsplit(state.get("base_url", "")).port == cfg.serve.port:
            return legacy, state
    return None


def base_url(cfg: DraftlineConfig) -> str:
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "::") else cfg.serve.host
    return f"http://{host}:{cfg.serve.port}"


def app_config(cfg: DraftlineConfig, served: ServedModel, engine_app: str = ENGINE_APPS[0]) -> dict[str, Any]:
    """The declarative application config (a ServeApplicationSchema mapping), also what `serve deploy` takes.

    serve.rollout=blue_green: the ingress alone, sending requests to the engine set in Serve app `engine_app`
    (engine_app_config); `served` is then that set's business."""
    if cfg.serve.rollout == "blue_green":
        deployments = [{"name": INGRESS_DEPLOYMENT, "user_config": {"engine_app": engine_app}}]
    else:
        deployments = [{"name": ENGINE_DEPLOYMENT, "user_config": served.model_dump()}]
    return {
        "name": APP_NAME,
        "route_prefix": "/",
        "import_path": APP_BUILDER_IMPORT_PATH,
        # Serve stores and shows args (dashboard, `serve status`): the config with credentials redacted, the served
        # version (so the app builder never needs the registry's credentials) and only the API token's sha256.
        "args": {"config": shown_config(cfg), "served": served.model_dump(),
                 "auth_token_sha256": auth_token_sha256_from_env(cfg)},
        "deployments": deployments,
    }


def engine_app_config(cfg: DraftlineConfig, served: ServedModel, name: str) -> dict[str, Any]:
    """One blue_green engine set: Serve app `name` (one of ENGINE_APPS) serving `served`, with no HTTP route."""
    return {
        "name": name,
        "route_prefix": None,
        "import_path": ENGINE_APP_BUILDER_IMPORT_PATH,
        "args": {"config": shown_config(cfg), "served": served.model_dump()},
        "deployments": [{"name": ENGINE_DEPLOYMENT, "user_config": served.model_dump()}],
    }


def _serve_client():
    # Serve's own path for declarative configs (what `serve run config.yaml` does); there is no public
    # Python API that applies a config, and the dashboard REST API is off on local clusters.
    from ray.serve.context import _get_global_client

    return _get_global_client()


def _apply(*apps: dict[str, Any], remove: tuple[str, ...] = ()) -> None:
    """Apply these apps' configs and delete the apps named in `remove`, keeping every other declaratively deployed
    app as it is."""
    from ray.serve.schema import ServeDeploySchema

    client = _serve_client()
    details = client.get_serve_details()
    changed = {app["name"] for app in apps} | set(remove)
    others = [
        app_details["deployed_app_config"]
        for name, app_details in details.get("applications", {}).items()
        if name not in changed and app_details.get("deployed_app_config")
    ]
    client.deploy_apps(ServeDeploySchema(applications=others + list(apps)))


def _deployed_app(name: str = APP_NAME) -> Optional[dict[str, Any]]:
    return _serve_client().get_serve_details().get("applications", {}).get(name)


def active_engine_app() -> str:
    """The Serve app whose engine replicas get new requests: APP_NAME itself, or with serve.rollout=blue_green the
    engine set the ingress's user_config names."""
    deployed = (_deployed_app() or {}).get("deployed_app_config") or {}
    ingress = next((d for d in deployed.get("deployments", []) if d.get("name") == INGRESS_DEPLOYMENT), {})
    return (ingress.get("user_config") or {}).get("engine_app") or APP_NAME


def engine_replicas(app_name: Optional[str] = None) -> list[dict[str, Any]]:
    """The engine replicas Serve knows of in `app_name` (default: the active set): replica_id, state, pid, node_id,
    actor_id (Serve's details)."""
    return _replicas(app_name or active_engine_app(), ENGINE_DEPLOYMENT)


def ingress_replicas() -> list[dict[str, Any]]:
    """The HTTP ingress replicas Serve knows of, as engine_replicas gives them."""
    return _replicas(APP_NAME, INGRESS_DEPLOYMENT)


def capture_replicas() -> list[dict[str, Any]]:
    """The traffic capture replica (serve.traffic.enabled), as engine_replicas gives them."""
    return _replicas(APP_NAME, CAPTURE_DEPLOYMENT)


def _replicas(app_name: str, deployment_name: str) -> list[dict[str, Any]]:
    deployment = (_deployed_app(app_name) or {}).get("deployments", {}).get(deployment_name, {})
    return [
        {key: replica.get(key) for key in ("replica_id", "state", "pid", "node_id", "actor_id")}
        for replica in deployment.get("replicas", [])
    ]


def wait_until_serving(
    cfg: DraftlineConfig, wanted: ServedModel, timeout_s: Optional[float] = None, engine_app: Optional[str] = None
) -> None:
    """Wait for the app to run and every replica (of `engine_app`, default the active engine set) to report `wanted`;
    raise ServingError on a failed swap."""
    from ray import serve

    engine_app = engine_app or active_engine_app()
    timeout_s = timeout_s or cfg.serve.rollout_timeout_s
    deadline = time.monotonic() + timeout_s
    handle = None
    # Replicas are picked at random per call: this many consecutive agreeing answers make a stale replica unlikely.
    agreeing_needed = 4 * cfg.serve.num_replicas
    agreeing = 0
    last_seen: Any = None
    while time.monotonic() < deadline:
        app = _deployed_app(engine_app)
        status = app and app["status"]
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            message = app.get("message", "") or (app.get("deployments", {}).get(ENGINE_DEPLOYMENT) or {}).get("message", "")
            raise ServingError(f"Serve app {engine_app} is {status}: {message[-2000:]}")
        deployment = (app or {}).get("deployments", {}).get(ENGINE_DEPLOYMENT, {})
        # A new replica whose engine cannot load this version (EngineServer.reconfigure's error, in Serve's message
        # on the deployment): Serve would start it twice more with the same files; fail now.
        cannot_start = f"could not start version {wanted.model_version} "
        failed = [line for line in (deployment.get("message") or "").splitlines() if cannot_start in line]
        if failed:
            raise ServingError(f"a replica of Serve app {engine_app} failed to start: {failed[-1].strip()[-600:]}")
        if status == "RUNNING" and deployment.get("status") == "HEALTHY":
            handle = handle or serve.get_deployment_handle(ENGINE_DEPLOYMENT, engine_app)
            state = handle.served.remote().result(timeout_s=30)
            last_seen = state
            served = state["served"]
            if served and served["model_version"] == wanted.model_version and served["registered_model"] == wanted.registered_model:
                agreeing += 1
                if agreeing >= agreeing_needed:
                    return
                continue
            agreeing = 0
            if state["last_error"] and wanted.model_version in state["last_error"]:
                raise ServingError(f"rollout to version {wanted.model_version} failed on a replica: {state['last_error']}")
        time.sleep(0.5)
    raise ServingError(
        f"Serve app {engine_app} did not serve version {wanted.model_version} within {timeout_s:.0f} s "
        f"(last replica answer: {last_seen}); see the Serve logs under the Ray session dir"
    )


def _write_state(cfg: DraftlineConfig, ray_mode: str) -> None:
    import ray

    # The token of a local cluster lives only in this process's environment; other local processes of the user
    # (`draftline promote` in another shell) read it from a 0600 file. A real cluster's token is the user's own.
    token_path = write_local_token(serve_state_dir(cfg) / "ray_auth_token") if ray_mode == "local" else None
    atomic_write_json(
        state_path(cfg),
        {
            "ray_address": ray.get_runtime_context().gcs_address,
            "ray_auth_mode": os.environ.get("RAY_AUTH_MODE", ""),
            "ray_auth_token_path": token_path,
            "local_cluster": ray_mode == "local",
            "base_url": base_url(cfg),
            "app_name": APP_NAME,
            "pid": os.getpid(),
        },
    )


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_serve(cfg: DraftlineConfig, proxy_timeout_s: float = 120) -> None:
    """serve.start on serve.host:port with serve.proxy_location; returns once Serve's HTTP proxies are up.

    Under load, Serve's controller can fail a new proxy's readiness check (5 s) three times and kill it while
    serve.start waits for it: serve.start then raises ActorDiedError naming ProxyActor (seen at load ~30 on a 2-core
    machine, and when a node died during the start). The controller is up by then and starts a new proxy itself, with
    a longer readiness timeout on each restart, so wait for that one instead of failing."""
    from ray import serve
    from ray.exceptions import ActorDiedError

    options = {"proxy_location": cfg.serve.proxy_location,
               "http_options": {"host": cfg.serve.host, "port": cfg.serve.port}}
    try:
        serve.start(**options)
        return
    except ActorDiedError as err:
        if "ProxyActor" not in str(err):
            raise
        logger.warning("Serve's controller restarted an HTTP proxy that was slow to start; waiting for the new one")
    serve.start(**options)  # connects to the controller started above
    deadline = time.monotonic() + proxy_timeout_s
    while True:
        proxies = _serve_client().get_serve_details().get("proxies") or {}
        statuses = {node: proxy.get("status") for node, proxy in proxies.items()}
        # DRAINING: a proxy on a node without replicas (proxy_location EveryNode), up but not taking new connections.
        if "HEALTHY" in statuses.values() and set(statuses.values()) <= {"HEALTHY", "DRAINING"}:
            return
        if time.monotonic() > deadline:
            raise ServingError(f"Serve's HTTP proxies were not up {proxy_timeout_s:.0f} s after a restart (status per "
                               f"node: {statuses}); see the proxy logs under the Ray session dir")
        time.sleep(0.5)


def serve_champion(cfg: DraftlineConfig, blocking: bool = False) -> str:
    """Start Serve on serve.host:port, deploy the champion (or the target alone), return the base URL.

    blocking=True keeps this process (and a local Ray it started) alive until interrupted.
    """
    from ray import serve

    ray_mode = ensure_ray(cfg)
    start_serve(cfg)
    served = resolve_served_model(cfg)
    if cfg.serve.rollout == "blue_green":
        _apply(engine_app_config(cfg, served, ENGINE_APPS[0]), app_config(cfg, served, ENGINE_APPS[0]),
               remove=ENGINE_APPS[1:])
        wait_until_serving(cfg, served, engine_app=ENGINE_APPS[0])
        _wait_for_app(APP_NAME, cfg.serve.rollout_timeout_s)
    else:
        _apply(app_config(cfg, served))
        wait_until_serving(cfg, served)
    _write_state(cfg, ray_mode)
    url = base_url(cfg)
    logger.info("serving %s version %s at %s/v1", served.registered_model, served.model_version, url)
    if blocking:
        print(f"serving {served.registered_model} version {served.model_version}", flush=True)
        block_until_interrupted(cfg)
    return url


def roll_to(cfg: DraftlineConfig, served: ServedModel, wait: bool = True) -> ServedModel:
    """Roll the running app to `served` through Serve's in-place reconfigure; raises ServingError if it did not."""
    from ray import serve

    app = _deployed_app()
    if app is None:
        raise ServingError(f"no Serve app named {APP_NAME} is running on this Ray cluster; start it with `draftline serve`")
    deployed = app.get("deployed_app_config")
    if cfg.serve.rollout == "blue_green":
        _roll_blue_green(cfg, served, deployed)
    elif deployed:
        deployed = dict(deployed)
        overrides = [d for d in deployed.get("deployments", []) if d.get("name") != ENGINE_DEPLOYMENT]
        engine = next((d for d in deployed.get("deployments", []) if d.get("name") == ENGINE_DEPLOYMENT), {})
        deployed["deployments"] = overrides + [{**engine, "name": ENGINE_DEPLOYMENT, "user_config": served.model_dump()}]
        _apply(deployed)
    else:
        serve.run(build_app(cfg, served), name=APP_NAME, route_prefix="/", blocking=False)
    if wait:
        wait_until_serving(cfg, served)
    logger.info("rolled %s to version %s", APP_NAME, served.model_version)
    return served


def _wait_for_app(name: str, timeout_s: float, gone: bool = False) -> None:
    """Wait until Serve app `name` is RUNNING (or, with `gone`, deleted); ServingError if it fails or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = _deployed_app(name)
        if (app is None) if gone else (app is not None and app["status"] == "RUNNING"):
            return
        if not gone and app is not None and app["status"] in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise ServingError(f"Serve app {name} is {app['status']}: {app.get('message', '')[-2000:]}")
        time.sleep(0.3)
    raise ServingError(f"Serve app {name} was not {'deleted' if gone else 'RUNNING'} within {timeout_s:.0f} s")


def _roll_blue_green(cfg: DraftlineConfig, served: ServedModel, deployed: Optional[dict[str, Any]]) -> None:
    """serve.rollout=blue_green: the new set up beside the old, then the switch, then the old set drains and stops."""
    active = active_engine_app()
    if not deployed or active not in ENGINE_APPS:
        raise ServingError(
            f"Serve app {APP_NAME} was not deployed with serve.rollout=blue_green (its engine set is not an app of "
            f"its own): restart it with `draftline serve` and this config, or roll with its own serve.rollout"
        )
    if serving_now(cfg) == served:  # e.g. a failed roll being undone: the old set never stopped serving
        wait_until_serving(cfg, served, engine_app=active)
        return
    spare = next(name for name in ENGINE_APPS if name != active)
    _apply(engine_app_config(cfg, served, spare))
    try:
        wait_until_serving(cfg, served, engine_app=spare)
    except ServingError:
        _apply(remove=(spare,))  # the new set goes; the old one never stopped serving
        _wait_for_app(spare, cfg.serve.drain_timeout_s + 60, gone=True)
        raise
    switched = dict(deployed)
    others = [d for d in deployed.get("deployments", []) if d.get("name") != INGRESS_DEPLOYMENT]
    ingress = next((d for d in deployed.get("deployments", []) if d.get("name") == INGRESS_DEPLOYMENT), {})
    switched["deployments"] = others + [{**ingress, "name": INGRESS_DEPLOYMENT, "user_config": {"engine_app": spare}}]
    _apply(switched)
    _wait_for_app(APP_NAME, cfg.serve.rollout_timeout_s)  # every ingress replica reconfigured: new requests go to spare
    logger.info("switched %s from %s to %s; the old set drains", APP_NAME, active, spare)
    _apply(remove=(active,))
    _wait_for_app(active, cfg.serve.drain_timeout_s + 60, gone=True)


def connect_to_serving(cfg: DraftlineConfig) -> bool:
    """Connect to ray.address / RAY_ADDRESS, else to the cluster `serve_champion` wrote in state.json.

    False when neither is there (or the local Ray in state.json belonged to a process that has exited).
    """
    import ray

    if ray.is_initialized():
        return True
    if cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        ensure_ray(cfg)
        return True
    record = serving_record(cfg)
    if record is None:
        return False
    path, state = record
    if state.get("local_cluster") and not _process_alive(state["pid"]):
        return False  # the local Ray of a `draftline serve` that has exited

    adopt_auth(state.get("ray_auth_mode", ""), state.get("ray_auth_token_path"))
    try:
        if state.get("local_cluster"):
            connect_local_cluster(state["ray_address"], log_to_driver=False)
        else:
            ray.init(address=state["ray_address"], log_to_driver=False)
    except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as err:
        # Ray 2.60: a missing token is an AuthenticationError; a wrong one is a ConnectionError after ~20 s of
        # retries. A local cluster whose process is alive is there, so failing to reach it is an error, not "idle".
        refused = isinstance(err, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(err)
        if refused or state.get("local_cluster"):
            alive = f", whose local Ray process {state.get('pid')} is still running" if state.get("local_cluster") else ""
            raise ServingError(
                f"could not connect to the Ray cluster at {state['ray_address']} that serves this data dir "
                f"({path}{alive}): "
                f"{str(err).strip().splitlines()[-1][:200]}. With token authentication, run with that cluster's "
                f"token in RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH (a local `draftline serve` saves its token at "
                f"{state.get('ray_auth_token_path')})"
            ) from err
        logger.info("serving recorded in %s is not reachable (%s)", path, err)
        return False
    return True


def serving_now(cfg: DraftlineConfig) -> Optional[ServedModel]:
    """What the running app for this data dir serves (its engine's user_config); None if nothing serves."""
    if not connect_to_serving(cfg):
        return None
    try:
        app = _deployed_app()
    except Exception as err:  # noqa: BLE001 - no Serve controller on that cluster
        logger.info("no Serve controller reachable: %s", err)
        return None
    if app is None:
        return None
    engine_app = active_engine_app()
    if engine_app != APP_NAME:  # blue_green: the engine set the ingress sends requests to
        app = _deployed_app(engine_app) or {}
    deployments = (app.get("deployed_app_config") or {}).get("deployments", [])
    engine = next((d for d in deployments if d.get("name") == ENGINE_DEPLOYMENT), None)
    if engine and engine.get("user_config"):
        return ServedModel.model_validate(engine["user_config"])
    from ray import serve

    # Deployed imperatively: ask a replica.
    state = serve.get_deployment_handle(ENGINE_DEPLOYMENT, engine_app).served.remote().result(timeout_s=30)
    return ServedModel.model_validate(state["user_config"])


def api_headers(cfg: DraftlineConfig) -> dict[str, str]:
    """HTTP headers for this config's endpoint: the bearer token from serve.auth_token_env, when set."""
    token = os.environ.get(cfg.serve.auth_token_env)
    return {"Authorization": f"Bearer {token}"} if token else {}


def smoke_chat_completion(cfg: DraftlineConfig, url: str, prompt: str = "What does `def join(a, *p)` in posixpath do?") -> dict:
    """One real chat completion over HTTP (the pipeline's last check); returns the reply and the version that served it."""
    import httpx

    headers = api_headers(cfg)
    body = {"model": cfg.registered_model_name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 32, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    if response.status_code != 200:
        raise ServingError(f"chat completion at {url} failed with HTTP {response.status_code}: {response.text[:300]}")
    data = response.json()
    return {
        "content": data["choices"][0]["message"]["content"],
        "version": data["draftline"]["model_version"],
        "usage": data.get("usage", {}),
    }


def block_until_interrupted(cfg: DraftlineConfig) -> None:
    """Keep this process (and the local Ray it may have started) alive while Serve answers; Ctrl-C stops."""
    from ray import serve

    print(f"serving at {base_url(cfg)}/v1 (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
