"""Faults of serving under load (issue 18, fault 5): SIGKILLed engine and ingress replicas, with the real Ray Serve.

Serve runs on 127.0.0.1 in the session's local Ray cluster, serving the test target (no champion in a tmp MLflow);
4 clients post chat completions while replica processes are killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import time


from conftest import free_port
from registry_helpers import mlflow_test_config
from serve_helpers import outcomes, start_serving, stop_serving, under_load, wait_for_answers


CLIENTS = 4


def _wait_for_replacement(listing, victim: dict, wanted: int, timeout_s: float = 600) -> float:
    """Seconds until Serve runs `wanted` replicas of `listing` (control.engine_replicas or ingress_replicas) again,
    none of them the killed one."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        running = [r for r in listing() if r["state"] == "RUNNING" and r["replica_id"] != victim["replica_id"]]
        if len(running) >= wanted:
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"Serve did not replace the killed replica {victim['replica_id']} within {timeout_s:.0f} s")


def _kill_one(listing, wanted: int) -> tuple[float, float]:
    """SIGKILL one running replica of `listing`; (monotonic time of the kill, seconds until Serve replaced it)."""
    victim = next(r for r in listing() if r["state"] == "RUNNING")
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    return killed_at, _wait_for_replacement(listing, victim, wanted)


def _report(what: str, results: list, killed_at: float, replaced_s: float, until: float) -> list:
    """Print the figures of one kill; the failed requests among those ending after the kill and before `until`."""
    window = [(start, end, outcome) for start, end, outcome in results if killed_at <= end < until]
    failures, _ = outcomes(window)
    slowest = max((end - start for start, end, _ in window), default=0.0)
    print(f"SIGKILL of {what} under load: {len(window)} requests ended from the kill until the next phase, "
          f"{len(failures)} failed ({[str(f)[:120] for f in failures[:3]]}); slowest {slowest:.1f} s; Serve replaced "
          f"the replica after {replaced_s:.1f} s (load {open('/proc/loadavg').read().split()[:3]})")
    return failures


def test_sigkill_of_an_engine_replica_then_an_ingress_replica_under_load_fails_no_request(
    ray_cluster, tiny_target_dir, tmp_path
):
    """2 engine and 2 ingress replicas, 4 clients; one engine replica is SIGKILLed, then (once Serve replaced it) one
    ingress replica.

    Engine: requests running on the killed replica are sent again by the ingress to the live one (nothing had reached
    the client), new ones go to the live one. Ingress: Ray's HTTP proxy would answer the requests the dead ingress
    had with a plain-text 500 (reverting serving/proxy_replay.py: the test fails that way); the proxy's draftline
    middleware runs them again on the other ingress replica. No request fails; whatever failed would have to be in
    OpenAI's error shape."""
    from draftline.serving.control import engine_replicas, ingress_replicas

    num_replicas = 2
    cfg = mlflow_test_config(tmp_path, [f"serve.port={free_port()}", f"serve.num_replicas={num_replicas}",
                                        "serve.ingress_replicas=2", "serve.cpus_per_replica=0.5"])
    url = start_serving(cfg)
    try:
        with under_load(url, max_s=900, clients=CLIENTS) as results:
            wait_for_answers(results, 2 * CLIENTS)
            engine_killed_at, engine_replaced_s = _kill_one(engine_replicas, num_replicas)
            wait_for_answers(results, CLIENTS, after=engine_killed_at + engine_replaced_s)
            ingress_killed_at, ingress_replaced_s = _kill_one(ingress_replicas, cfg.serve.ingress_replicas)
            wait_for_answers(results, CLIENTS, after=ingress_killed_at + ingress_replaced_s)
    finally:
        stop_serving()
    failures, versions = outcomes(results)
    before = [end - start for start, end, _ in results if end < engine_killed_at]
    print(f"{len(results)} requests in all, {len(failures)} failed; slowest before the first kill {max(before):.1f} s")
    _report(f"1 of {num_replicas} engine replicas", results, engine_killed_at, engine_replaced_s, ingress_killed_at)
    _report(f"1 of {cfg.serve.ingress_replicas} ingress replicas", results, ingress_killed_at, ingress_replaced_s,
            float("inf"))
    assert versions and not [f for f in failures if not f.openai_shaped], failures
    assert failures == []


def test_serve_start_waits_for_the_new_proxy_when_the_first_was_killed(ray_cluster, tmp_path):
    """Serve's controller kills an HTTP proxy that fails its readiness checks (under load) while serve.start waits for
    it, and serve.start raises ActorDiedError. Here the test kills it the same way (ray.kill, no restart) as soon as
    it exists: control.start_serve (the path of `draftline serve`) waits for the controller's new proxy instead."""
    import threading

    import httpx
    import ray
    from ray.serve._private.constants import NO_ROUTES_MESSAGE

    from draftline.serving.control import base_url, start_serve

    cfg = mlflow_test_config(tmp_path, [f"serve.port={free_port()}"])
    proxy_name = f"SERVE_PROXY_ACTOR-{ray.get_runtime_context().get_node_id()}"
    killed: list = []

    def kill_the_proxy_once_it_exists() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                proxy = ray.get_actor(proxy_name, namespace="serve")
            except ValueError:
                time.sleep(0.01)
                continue
            ray.kill(proxy, no_restart=True)
            killed.append(proxy._actor_id.hex())
            return

    stop_serving()
    killer = threading.Thread(target=kill_the_proxy_once_it_exists, daemon=True)
    killer.start()
    try:
        start_serve(cfg)
        killer.join(timeout=10)
        assert killed, "the proxy was not killed"
        assert ray.get_actor(proxy_name, namespace="serve")._actor_id.hex() != killed[0]
        # The new proxy answers on serve.port (with no app deployed: its 503 "Route table is not populated yet.").
        response = httpx.get(f"{base_url(cfg)}/-/routes", timeout=30)
        assert response.text == NO_ROUTES_MESSAGE, response.text
    finally:
        stop_serving()
