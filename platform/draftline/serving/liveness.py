"""Is the endpoint a serve stage recorded still serving, for this run? Its output is a live service, not a file.

A record of having served once says nothing about now: `make demo` stops its local Ray (and the endpoint with it)
when it exits, and a fresh `ray start --head` has no Serve app. `serving_now` holds a record to what is true:
this run talks to the Ray cluster that served (the same session: a head restarted on the same address is a new
cluster), the Serve app runs there, and the recorded URL answers `/v1/models` with the registry champion.
"""

from __future__ import annotations

import shlex
import socket
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

from draftline.config import DraftlineConfig
from draftline.raycluster import configured_ray_address, ensure_ray
from draftline.records import StageRecord, written_if_set
from draftline.registry import RegistryError
from draftline.serving.app import APP_NAME
from draftline.serving.control import ServingError, api_headers, base_url, state_path
from draftline.serving.served_model import resolve_served_model
from draftline.utils import read_json


@dataclass(frozen=True)
class ServeRecord(StageRecord):
    """The serve stage's output: the endpoint, what it answered, and the Ray cluster it runs on."""

    STAGE = "serve"
    url: str
    version: str  # the served version ("target-only" without a champion)
    completion: str  # the smoke test's reply
    # Not in records written before the serve stage recorded its cluster: such a record never counts as serving.
    ray_address: Optional[str] = written_if_set()
    ray_session: Optional[str] = written_if_set()
    local_cluster: Optional[bool] = written_if_set()  # a local Ray this run started, which stops with the run


def current_cluster(cfg: DraftlineConfig) -> Optional[dict]:
    """{"ray_address", "ray_session"} of the cluster this run talks to (connecting to a configured one first);
    None when this process has no Ray yet and would start its own local one."""
    import ray

    if not ray.is_initialized():
        if not configured_ray_address(cfg):
            return None

        ensure_ray(cfg)
    context = ray.get_runtime_context()
    return {"ray_address": context.gcs_address, "ray_session": context.get_session_name()}


def served_model(cfg: DraftlineConfig, url: str) -> dict:
    """What `GET {url}/v1/models` reports: {"registered_model", "model_version", "backend"}; ServingError if not."""
    import httpx

    try:
        response = httpx.get(f"{url}/v1/models", headers=api_headers(cfg), timeout=30)
    except httpx.HTTPError as err:
        raise ServingError(f"nothing answers at {url}/v1/models ({type(err).__name__}: {err})") from None
    if response.status_code != 200:
        raise ServingError(f"{url}/v1/models answered HTTP {response.status_code}: {response.text[:200]}")
    return response.json()["data"][0]["draftline"]


def serving_now(cfg: DraftlineConfig, recorded: ServeRecord) -> dict:
    """{"serving": True, url, registered_model, model_version, ray_address, ray_session} when the serve stage's
    record still holds for this run, else {"serving": False, "reason": why not}."""
    from ray import serve

    def no(reason: str) -> dict:
        return {"serving": False, "reason": reason}

    served_on = (f"Ray cluster {recorded.ray_address} ({recorded.ray_session})" if recorded.ray_session
                 else "a Ray cluster it did not record")
    cluster = current_cluster(cfg)
    if cluster is None:
        return no(f"it served on {served_on}; this run starts its own local Ray")
    if cluster["ray_session"] != recorded.ray_session:
        return no(f"it served on {served_on}; this run talks to {cluster['ray_address']} ({cluster['ray_session']})")
    app = serve.status().applications.get(APP_NAME)
    if app is None or app.status != "RUNNING":
        return no(f"Serve app {APP_NAME} is {app.status if app else 'not deployed'} on {cluster['ray_address']}")
    url = recorded.url
    try:
        answered = served_model(cfg, url)
        champion = resolve_served_model(cfg)
    except (ServingError, RegistryError) as err:
        return no(str(err))
    if (answered["registered_model"], answered["model_version"]) != (champion.registered_model, champion.model_version):
        return no(f"{url} serves {answered['registered_model']} version {answered['model_version']}; "
                  f"the champion is version {champion.model_version}")
    return {"serving": True, "url": url, "registered_model": answered["registered_model"],
            "model_version": answered["model_version"], **cluster}


def serving_at_exit(cfg: DraftlineConfig, recorded: ServeRecord, keep_serving: bool, start_command: str) -> dict:
    """What will be true once this run ends: serving_now, except that a local Ray this process started ends with it."""
    if recorded.local_cluster and not keep_serving:
        state = {"serving": False, "reason": "the local Ray cluster this run started stops when the run ends, "
                                             "and the endpoint with it"}
    else:
        state = {**serving_now(cfg, recorded), "local_cluster": bool(recorded.local_cluster)}
    if not state["serving"]:
        state["start_command"] = start_command
    return state


def start_command(program: str, config_path: str, overrides: list[str], local: bool) -> str:
    """The command that serves this config's champion and keeps serving (a local Ray lives as long as it runs)."""
    return shlex.join([program, "serve", *([] if local else ["--detach"]), "--config", config_path, *overrides])


def refuse_foreign_port(cfg: DraftlineConfig) -> None:
    """Before Serve starts: fail clearly when something other than this run's own Serve holds serve.port.

    Ray Serve's own error is a `Failed to bind` deep in a proxy actor's traceback; the usual cause is the endpoint of
    another Ray cluster (a `draftline serve` in another shell, or a cluster from an earlier `ray start`). Checked
    before a run starts its own local Ray, so that it fails at once.
    """
    from ray import serve

    url = base_url(cfg)
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=2).close()
    except OSError:
        return  # free
    if current_cluster(cfg) is not None and serve.status().proxies:
        return  # this run's cluster already runs Serve: a redeploy there
    try:
        answered = served_model(cfg, url)
        what = f"a draftline endpoint serving {answered['registered_model']} version {answered['model_version']}"
    except ServingError as err:
        what = f"something that is not this run's Serve ({err})"
    last = read_json(state_path(cfg)) if state_path(cfg).exists() else {}
    where = f" (this data dir last served from Ray cluster {last['ray_address']})" if last.get("ray_address") else ""
    raise ServingError(
        f"serve.port {cfg.serve.port} on {parts.hostname} is already taken by {what}{where}, on a Ray cluster other "
        f"than this run's. Run against that cluster (RAY_ADDRESS=<its address>) to keep using it, stop it, or "
        f"choose another port (serve.port=N)."
    )
