"""Connecting to Ray: a real cluster when RAY_ADDRESS / ray.address is set, else a local one on 127.0.0.1.

Token authentication (Ray >= 2.5x turns it on for clusters it starts): on a real cluster draftline never touches
it; jobs authenticate with the cluster's token (RAY_AUTH_TOKEN / ~/.ray/auth_token), and configs/cluster/ sets
RAY_AUTH_MODE=token. For the local cluster this process starts itself, bound to 127.0.0.1 and gone when the
process exits, we set RAY_AUTH_MODE=disabled explicitly (unless the user set a mode): nothing off this machine
can reach it, and a token would be one more per-user file (~/.ray/auth_token) that concurrent test runs and CI
would have to share. Set RAY_AUTH_MODE=token before starting to keep token auth locally too.
"""

from __future__ import annotations

import os

from draftline.config import DraftlineConfig


def ensure_ray(cfg: DraftlineConfig | None = None, num_cpus: int | None = None) -> str:
    """Initialise Ray once per process; returns 'cluster' or 'local'."""
    import ray

    if ray.is_initialized():
        return "cluster" if os.environ.get("RAY_ADDRESS") else "local"
    address = (cfg.ray.address if cfg else None) or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return "cluster"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Workers must import draftline even when it is not pip-installed (e.g. `python jobs/x.py` from a checkout).
    source_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pythonpath = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        address="local",
        num_cpus=num_cpus or (cfg.ray.num_cpus if cfg else None),
        # The dashboard serves Ray's state API, which Ray Train polls; it binds to loopback like the rest.
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]}},
        log_to_driver=True,
    )
    return "local"
