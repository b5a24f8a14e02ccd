"""Building the Serve application from config: OpenAI ingress -> engine replicas."""

from __future__ import annotations

import os
import re
from typing import Any, Optional

from ray.serve.config import BackpressureConfig

from draftline.config import ConfigError, DraftlineConfig
from draftline.serving.engine_server import EngineServer
from draftline.serving.openai_api import Ingress, token_hash
from draftline.serving.served_model import ServedModel, resolve_served_model
from draftline.serving.traffic_capture import TrafficCapture

APP_NAME = "draftline"
# serve.rollout=blue_green: the engine replicas run as their own Serve app, one of these two; the ingress (in APP_NAME)
# sends requests to the one its user_config names, and a rollout brings up the other beside it, then switches.
ENGINE_APPS = (f"{APP_NAME}-engine-blue", f"{APP_NAME}-engine-green")

_FROM_ENV = object()


def auth_token_sha256_env(cfg: DraftlineConfig) -> str:
    """The env var that may hold the token's sha256 instead of the token: `<serve.auth_token_env>_SHA256`."""
    return f"{cfg.serve.auth_token_env}_SHA256"


def auth_token_sha256_from_env(cfg: DraftlineConfig) -> Optional[str]:
    """sha256 of the bearer token in the env var named by serve.auth_token_env, else the sha256 itself from
    `<serve.auth_token_env>_SHA256` (None: auth off).

    Only the hash travels to the replicas, so the token never appears in Serve's config, the dashboard or a
    replica's environment. Where the app is built inside the cluster (`serve run serve/serve_config.yaml`), the
    runtime_env's env_vars reach every replica: that is where the _SHA256 variable belongs, not the token.
    """
    token = os.environ.get(cfg.serve.auth_token_env, "").strip()
    if token:
        return token_hash(token)
    name = auth_token_sha256_env(cfg)
    digest = os.environ.get(name, "").strip().lower()
    if not digest:
        return None
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ConfigError(f"{name} must be the sha256 of the API token as 64 hex digits, e.g. the first field of "
                          f"`printf %s \"$TOKEN\" | sha256sum`; got {len(digest)} characters")
    return digest


def engine_options(cfg: DraftlineConfig, served: ServedModel) -> dict:
    """Serve options of the engine deployment (also the `deployments` override in a declarative config)."""
    return {
        "num_replicas": cfg.serve.num_replicas,
        "max_ongoing_requests": cfg.serve.max_ongoing_requests,
        "max_queued_requests": cfg.serve.max_queued_requests,
        "max_surge_percent": cfg.serve.max_surge_percent,
        "ray_actor_options": {"num_cpus": cfg.serve.cpus_per_replica, "num_gpus": cfg.serve.gpus_per_replica},
        "user_config": served.model_dump(),
        "graceful_shutdown_timeout_s": cfg.serve.drain_timeout_s,
        "health_check_period_s": 5,
        "health_check_timeout_s": 60,
    }


def build_engine_app(cfg: DraftlineConfig, served: Optional[ServedModel] = None):
    """The engine deployment alone: one blue_green engine set (its own Serve app, no HTTP route)."""
    return EngineServer.options(**engine_options(cfg, served or resolve_served_model(cfg))).bind(cfg.model_dump(mode="json"))


def build_app(
    cfg: DraftlineConfig,
    served: Optional[ServedModel] = None,
    auth_token_sha256: Any = _FROM_ENV,
    engine_app: Optional[str] = None,
):
    """The Serve application for `cfg`: ingress -> engine. `served` defaults to the registry champion.

    With serve.rollout=blue_green the app is the ingress alone; its user_config names the Serve app of the engine
    set it sends requests to (`engine_app`, one of ENGINE_APPS, deployed beside it by control.serve_champion)."""
    config = cfg.model_dump(mode="json")
    if auth_token_sha256 is _FROM_ENV:
        auth_token_sha256 = auth_token_sha256_from_env(cfg)
    # The ingress admits what the engines can run or queue, plus headroom for /healthz and /v1/models.
    engine_capacity = cfg.serve.num_replicas * (cfg.serve.max_ongoing_requests + max(cfg.serve.max_queued_requests, 0))
    options: dict[str, Any] = {}
    if cfg.serve.rollout == "blue_green":
        if engine_app not in ENGINE_APPS:
            raise ValueError(
                "serve.rollout=blue_green runs the engine sets as Serve apps of their own beside the ingress: start "
                "it with `draftline serve` (or serve_champion), not `serve run`; or set serve.rollout to beside or "
                "drain_and_swap"
            )
        engine, options["user_config"] = None, {"engine_app": engine_app}
    else:
        engine = EngineServer.options(**engine_options(cfg, served or resolve_served_model(cfg))).bind(config)
    # serve.traffic.enabled: the capture actor, one replica of its own deployment beside the ingress.
    traffic = TrafficCapture.bind(config) if cfg.serve.traffic.enabled else None
    return Ingress.options(
        num_replicas=cfg.serve.ingress_replicas,
        max_ongoing_requests=engine_capacity + 16,
        max_queued_requests=max(cfg.serve.max_queued_requests, 0) + 16,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=cfg.serve.retry_after_s),
        ray_actor_options={"num_cpus": cfg.serve.ingress_cpus_per_replica},
        **options,
    ).bind(engine, config, auth_token_sha256, traffic)


def app_builder(args: dict):
    """Serve application builder for declarative configs: args {"config": <resolved config>, "served" (optional: the
    engine's user_config; default the registry champion), "auth_token_sha256"}."""
    if "config" not in args:
        raise ValueError("draftline app args need 'config' (a resolved draftline config mapping)")
    cfg = DraftlineConfig.model_validate(args["config"])
    served = ServedModel.model_validate(args["served"]) if args.get("served") else None
    # blue_green: the engine set the ingress starts with; the deployed config's ingress user_config overrides it.
    return build_app(cfg, served, auth_token_sha256=args.get("auth_token_sha256"), engine_app=ENGINE_APPS[0])


def engine_app_builder(args: dict):
    """Serve application builder of one blue_green engine set: args {"config": <resolved config>, "served": ServedModel}."""
    if "config" not in args or "served" not in args:
        raise ValueError("draftline engine app args need 'config' (a resolved draftline config mapping) and 'served'")
    return build_engine_app(DraftlineConfig.model_validate(args["config"]), ServedModel.model_validate(args["served"]))
