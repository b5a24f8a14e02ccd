"""Starting Serve, finding what it serves, and rolling it to a given version.

- `serve_champion(cfg)`: start Serve on serve.host/port and deploy the app *declaratively* (the path of
  `serve deploy`): import path `draftline.serving.app:app_builder`, args = the resolved config (credentials
  redacted), the served version and the API token's sha256, and the
  engine deployment's `user_config` = the champion. Writes `<data_dir>/serve/state.json` so other processes
  (`draftline promote`, `draftline serve --roll`) can find the cluster.
- `serving_now(cfg)`: the version a running app serves (None when nothing serves for this data dir).
- `roll_to(cfg, served)`: re-apply the deployed app config with only the engine's user_config changed. Serve sees
  a user_config-only change and reconfigures the replicas in place; how a replica swaps engines is the rollout
  strategy (serve.rollout, see engine_server.py). An app deployed imperatively (`serve run serve.app:app`) has no
  stored config: it is redeployed with `serve.run`, which replaces replicas.
The registry never calls this module: draftline.release rolls serving first and moves the alias after.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from draftline.config import DraftlineConfig, shown_config
from draftline.serving.app import APP_NAME, auth_token_sha256_from_env, build_app
from draftline.serving.engine_server import ENGINE_DEPLOYMENT
from draftline.serving.served_model import ServedModel, resolve_served_model
from draftline.utils import atomic_write_json

logger = logging.getLogger(__name__)

APP_BUILDER_IMPORT_PATH = "draftline.serving.app:app_builder"


class ServingError(RuntimeError):
    """Serve is not running where expected, or a rollout did not converge; phrased for the user."""


def state_path(cfg: DraftlineConfig) -> Path:
    return cfg.data_path("serve", "state.json")


def base_url(cfg: DraftlineConfig) -> str:
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "::") else cfg.serve.host
    return f"http://{host}:{cfg.serve.port}"


def app_config(cfg: DraftlineConfig, served: ServedModel) -> dict[str, Any]:
    """The declarative application config (a ServeApplicationSchema mapping), also what `serve deploy` takes."""
    return {
        "name": APP_NAME,
        "route_prefix": "/",
        "import_path": APP_BUILDER_IMPORT_PATH,
        # Serve stores and shows args (dashboard, `serve status`): the config with credentials redacted, the served
        # version (so the app builder never needs the registry's credentials) and only the API token's sha256.
        "args": {"config": shown_config(cfg), "served": served.model_dump(),
                 "auth_token_sha256": auth_token_sha256_from_env(cfg)},
        "deployments": [{"name": ENGINE_DEPLOYMENT, "user_config": served.model_dump()}],
    }


def _serve_client():
    # Serve's own path for declarative configs (what `serve run config.yaml` does); there is no public
    # Python API that applies a config, and the dashboard REST API is off on local clusters.
    from ray.serve.context import _get_global_client

    return _get_global_client()


def _apply(app: dict[str, Any]) -> None:
    """Apply one app's config, keeping every other declaratively deployed app as it is."""
    from ray.serve.schema import ServeDeploySchema

    client = _serve_client()
    details = client.get_serve_details()
    others = [
        app_details["deployed_app_config"]
        for name, app_details in details.get("applications", {}).items()
        if name != app["name"] and app_details.get("deployed_app_config")
    ]
    client.deploy_apps(ServeDeploySchema(applications=others + [app]))


def _deployed_app(name: str = APP_NAME) -> Optional[dict[str, Any]]:
    return _serve_client().get_serve_details().get("applications", {}).get(name)


def wait_until_serving(cfg: DraftlineConfig, wanted: ServedModel, timeout_s: Optional[float] = None) -> None:
    """Wait for the app to run and every replica to report `wanted`; raise ServingError on a failed swap."""
    from ray import serve

    timeout_s = timeout_s or cfg.serve.rollout_timeout_s
    deadline = time.monotonic() + timeout_s
    handle = None
    # Replicas are picked at random per call: this many consecutive agreeing answers make a stale replica unlikely.
    agreeing_needed = 4 * cfg.serve.num_replicas
    agreeing = 0
    last_seen: Any = None
    while time.monotonic() < deadline:
        app = _deployed_app()
        status = app and app["status"]
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise ServingError(f"Serve app {APP_NAME} is {status}: {app.get('message', '')}")
        deployment = (app or {}).get("deployments", {}).get(ENGINE_DEPLOYMENT, {})
        if status == "RUNNING" and deployment.get("status") == "HEALTHY":
            handle = handle or serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP_NAME)
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
        f"Serve app {APP_NAME} did not serve version {wanted.model_version} within {timeout_s:.0f} s "
        f"(last replica answer: {last_seen}); see the Serve logs under the Ray session dir"
    )


def _write_state(cfg: DraftlineConfig, ray_mode: str) -> None:
    import ray

    from draftline.raycluster import write_local_token

    # The token of a local cluster lives only in this process's environment; other local processes of the user
    # (`draftline promote` in another shell) read it from a 0600 file. A real cluster's token is the user's own.
    token_path = write_local_token(cfg.data_path("serve", "ray_auth_token")) if ray_mode == "local" else None
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


def serve_champion(cfg: DraftlineConfig, blocking: bool = False) -> str:
    """Start Serve on serve.host:port, deploy the champion (or the target alone), return the base URL.

    blocking=True keeps this process (and a local Ray it started) alive until interrupted.
    """
    from ray import serve

    from draftline.raycluster import ensure_ray

    ray_mode = ensure_ray(cfg)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    served = resolve_served_model(cfg)
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
    if deployed:
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


def connect_to_serving(cfg: DraftlineConfig) -> bool:
    """Connect to ray.address / RAY_ADDRESS, else to the cluster `serve_champion` wrote in state.json.

    False when neither is there (or the local Ray in state.json belonged to a process that has exited).
    """
    import ray

    if ray.is_initialized():
        return True
    if cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        from draftline.raycluster import ensure_ray

        ensure_ray(cfg)
        return True
    path = state_path(cfg)
    if not path.exists():
        return False
    state = json.loads(path.read_text())
    if state.get("local_cluster") and not _process_alive(state["pid"]):
        return False  # the local Ray of a `draftline serve` that has exited
    from draftline.raycluster import adopt_auth, connect_local_cluster

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
    deployments = (app.get("deployed_app_config") or {}).get("deployments", [])
    engine = next((d for d in deployments if d.get("name") == ENGINE_DEPLOYMENT), None)
    if engine and engine.get("user_config"):
        return ServedModel.model_validate(engine["user_config"])
    from ray import serve

    # Deployed imperatively: ask a replica.
    state = serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP_NAME).served.remote().result(timeout_s=30)
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
