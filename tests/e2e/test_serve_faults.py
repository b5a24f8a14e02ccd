"""Faults of serving under load (issue 18, fault 5): a SIGKILLed engine replica, with the real Ray Serve.

Serve runs on 127.0.0.1 in the session's local Ray cluster, serving the test target (no champion in a tmp MLflow);
4 clients post chat completions while one engine replica's process is killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import free_port
from registry_helpers import mlflow_test_config
from serve_helpers import outcomes, start_serving, stop_serving, under_load

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _wait_for_replacement(victim: dict, wanted: int, timeout_s: float = 600) -> float:
    """Seconds until Serve runs `wanted` engine replicas again, none of them the killed one."""
    from draftline.serving.control import engine_replicas

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        running = [r for r in engine_replicas() if r["state"] == "RUNNING" and r["replica_id"] != victim["replica_id"]]
        if len(running) >= wanted:
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"Serve did not replace the killed replica {victim['replica_id']} within {timeout_s:.0f} s")


def test_sigkill_of_an_engine_replica_under_load_fails_no_request(ray_cluster, tiny_target_dir, tmp_path):
    """With 2 replicas, requests running on the killed one are sent again to the live one (nothing had reached the
    client) and new ones go to the live one: no request fails. Whatever failed would have to be in OpenAI's error
    shape, never a plain-text 500. (With 1 replica the retries wait for Serve's replacement: docs/serving.md.)"""
    from draftline.serving.control import engine_replicas

    num_replicas = 2
    cfg = mlflow_test_config(tmp_path, [f"serve.port={free_port()}", f"serve.num_replicas={num_replicas}",
                                        "serve.cpus_per_replica=0.5"])
    url = start_serving(cfg)
    try:
        with under_load(url, max_s=600) as results:
            time.sleep(4)
            victim = next(r for r in engine_replicas() if r["state"] == "RUNNING")
            killed_at = time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)
            replaced_s = _wait_for_replacement(victim, num_replicas)
            time.sleep(3)
    finally:
        stop_serving()
    failures, versions = outcomes(results)
    before = [end - start for start, end, _ in results if end < killed_at]
    around = [end - start for start, end, _ in results if end >= killed_at and start <= killed_at + replaced_s]
    print(f"SIGKILL of 1 of {num_replicas} engine replicas under load: {len(results)} requests, {len(failures)} failed "
          f"({[str(f)[:120] for f in failures[:3]]}), slowest before the kill {max(before):.1f} s, slowest in flight "
          f"or started until the replacement ran {max(around):.1f} s; Serve replaced the replica after {replaced_s:.1f} s "
          f"(load {open('/proc/loadavg').read().split()[:3]})")
    assert versions and not [f for f in failures if not f.openai_shaped], failures
    assert failures == []
