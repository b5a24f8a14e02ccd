"""Zero-downtime rollout between two real registered drafter versions under concurrent load.

Two randomly initialised Eagle3Drafter exports are registered in a tmp MLflow store, gated (tag gate=passed)
and promoted with the registry; Serve runs on 127.0.0.1 in the session's local Ray cluster.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from conftest import REPO, TEST_OVERRIDES, VLLM_TEST_OVERRIDES, free_port
from draftline.tracking import GATE_TAG
from registry_helpers import mlflow_test_config, random_drafter, register_drafter
from serve_helpers import CHAT_BODY as BODY, outcomes, start_serving, stop_serving, under_load, wait_for_answers


CLIENTS = 4
MAX_LOAD_S = 40.0


@pytest.fixture(scope="module")
def registry(ray_cluster, tmp_path_factory, tiny_target_dir):
    """Two gate-passed versions; the first is the champion."""
    from draftline.registry import promote

    tmp_path = tmp_path_factory.mktemp("serve-rollout")
    extra = [f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"tracking.artifact_location={(tmp_path / 'mlruns').as_uri()}"]
    cfg = mlflow_test_config(tmp_path)
    old = register_drafter(cfg, random_drafter(tiny_target_dir, seed=1), {GATE_TAG: "passed"})
    new = register_drafter(cfg, random_drafter(tiny_target_dir, seed=2), {GATE_TAG: "passed"})
    promote(cfg, old)
    return extra, old, new


def serving_on(cfg, url: str, version: int) -> None:
    """The running app serves `version`, as champion, whatever an earlier test left: rolled to it if needed."""
    from draftline.registry import alias_version_number
    from draftline.release import promote_and_roll

    if httpx.get(f"{url}/healthz", timeout=30).json()["served"]["model_version"] != version:
        promote_and_roll(cfg, version)
    assert alias_version_number(cfg) == version
    assert httpx.get(f"{url}/healthz", timeout=30).json()["served"]["model_version"] == version


def check_promotion_under_load(cfg, url: str, old: int, new: int, max_load_s: float, label: str) -> None:
    """`url` serves `old`; promote_and_roll to `new` under CLIENTS clients: no request fails, both versions answer,
    and every request started after the call returned gets `new`."""
    from draftline.registry import alias_version_number
    from draftline.release import promote_and_roll

    with under_load(url, max_load_s, CLIENTS) as results:
        wait_for_answers(results, CLIENTS)  # old version under load first
        roll_started = time.monotonic()
        message = promote_and_roll(cfg, new)
        rolled_at = time.monotonic()
        wait_for_answers(results, CLIENTS, after=rolled_at)  # new version under load
    failures, versions = outcomes(results)
    late = Counter(outcome for started, _, outcome in results if started > rolled_at)
    print(
        f"{label} rollout {old}->{new}: {len(results)} requests from {CLIENTS} clients, {len(failures)} failed, "
        f"versions {dict(versions)}, promote_and_roll took {rolled_at - roll_started:.1f} s, "
        f"requests started after the roll: {dict(late)}"
    )
    assert f"now serves {cfg.registered_model_name} version {new}" in message
    assert alias_version_number(cfg) == new
    assert failures == []
    assert set(versions) == {old, new} and versions[old] > 0 and versions[new] > 0
    assert late and set(late) == {new}, "a request started after the promotion returned was answered by the old version"


def _config_that_does_not_fit_its_weights(export_dir: Path) -> None:
    config = json.loads((export_dir / "config.json").read_text())
    config["intermediate_size"] += 32
    (export_dir / "config.json").write_text(json.dumps(config))


# Connects the way `draftline promote`/`rollback` do, without touching the registry; exit 3 on a ServingError.
PROBE_CONNECT = """
import sys
from draftline.config import load_config
from draftline.serving.control import ServingError, connect_to_serving
try:
    connect_to_serving(load_config(sys.argv[1], sys.argv[2:]))
except ServingError as err:
    print("SERVING-ERROR", err)
    sys.exit(3)
"""


class TestOneReferenceApp:
    """serve.rollout beside (the default), one replica of the reference engine: one Serve app for the three tests,
    each of which first puts on it the version it starts from (`serving_on`)."""

    @pytest.fixture(scope="class")
    def app(self, registry, tmp_path_factory):
        """-> (cfg, url, port) of the running app."""
        from draftline.registry import promote

        extra, old, _ = registry
        port = free_port()
        cfg = mlflow_test_config(tmp_path_factory.mktemp("reference-app"), extra + [f"serve.port={port}"])
        promote(cfg, old)
        url = start_serving(cfg)
        try:
            yield cfg, url, port
        finally:
            stop_serving()

    def test_promotion_rolls_serving_without_failed_requests(self, registry, app):
        _, old, new = registry
        cfg, url, _ = app
        serving_on(cfg, url, old)
        check_promotion_under_load(cfg, url, old, new, MAX_LOAD_S, "reference")

    def test_rollback_command_rolls_running_serving(self, registry, app):
        """`draftline rollback` (the registry CLI) finds the running app through state.json and rolls it."""
        from draftline.serving.control import serve_state_dir

        extra, old, new = registry
        cfg, url, port = app
        serving_on(cfg, url, old)
        serving_on(cfg, url, new)  # champion = new, previous = old (whatever the previous test left)
        assert httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=120).json()["draftline"]["model_version"] == new
        overrides = TEST_OVERRIDES + [f"data_dir={cfg.data_dir}"] + extra + [f"serve.port={port}"]
        command = [sys.executable, "-m", "draftline.cli", "rollback", "-c", str(REPO / "configs" / "tiny-cpu.yaml"), *overrides]
        # Like a user's second shell: no RAY_AUTH_TOKEN; the token comes from the 0600 file state.json names.
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
        env["PYTHONPATH"] = str(REPO / "platform")
        token_file = serve_state_dir(cfg) / "ray_auth_token"
        if os.environ.get("RAY_AUTH_MODE") == "token":
            assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
            # A wrong token: connecting (before anything in the registry changes) fails with a message, not silence.
            refused = subprocess.run([sys.executable, "-c", PROBE_CONNECT, str(REPO / "configs" / "tiny-cpu.yaml"), *overrides],
                                     capture_output=True, text=True, timeout=300, env={**env, "RAY_AUTH_TOKEN": "0" * 64})  # fmt: skip
            assert refused.returncode == 3, refused.stdout[-3000:] + refused.stderr[-3000:]
            assert "could not connect" in refused.stdout and "RAY_AUTH_TOKEN" in refused.stdout
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        print(f"`draftline rollback` took {time.monotonic() - started:.1f} s:\n{done.stdout}{done.stderr[-2000:]}")
        assert done.returncode == 0
        assert f"now serves {cfg.registered_model_name} version {old}" in done.stdout
        answers = {httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=120).json()["draftline"]["model_version"]
                   for _ in range(4)}
        assert answers == {old}

    def test_failed_roll_leaves_registry_and_serving_as_they_were(self, registry, app, tiny_target_dir):
        """Transactional promotion: a version whose files verify but whose engine cannot start (its config does not
        fit its weights) fails on the replicas; the alias stays, every replica goes on serving the old version, 0
        requests fail."""
        from draftline.registry import alias_version_number
        from draftline.release import ReleaseError, promote_and_roll

        _, old, _ = registry
        cfg, url, _ = app
        broken = register_drafter(cfg, random_drafter(tiny_target_dir, seed=3), {GATE_TAG: "passed"},
                                  damage=_config_that_does_not_fit_its_weights)
        serving_on(cfg, url, old)
        champion, previous = alias_version_number(cfg), alias_version_number(cfg, "previous")
        with under_load(url) as results:
            wait_for_answers(results, CLIENTS)
            with pytest.raises(ReleaseError, match=rf"did not roll to .*version {broken}.*back on version {old}.*registry is unchanged"):
                promote_and_roll(cfg, broken)
            wait_for_answers(results, CLIENTS, after=time.monotonic())
        assert (alias_version_number(cfg), alias_version_number(cfg, "previous")) == (champion, previous)
        health = httpx.get(f"{url}/healthz", timeout=30).json()
        assert health["served"]["model_version"] == old and health["last_error"] is None
        failures, versions = outcomes(results)
        print(f"failed roll to {broken}: {len(results)} requests, {len(failures)} failed, versions {dict(versions)}")
        assert failures == [] and set(versions) == {old}


def test_promotion_rolls_vllm_serving_without_failed_requests(registry, tmp_path_factory):
    """vLLM's CPU build as the replicas' engine: one server per version, the new one started beside the old
    (serve.rollout beside), so the load has to outlast a vLLM start-up. The interpreter is named as a cluster config
    names it (there a replica imports draftline from Ray's copy of it, with no .venv-vllm beside it)."""
    from draftline.registry import promote

    extra, old, new = registry
    overrides = VLLM_TEST_OVERRIDES + [f"engine.vllm.python={REPO / '.venv-vllm' / 'bin' / 'python'}"]
    cfg = mlflow_test_config(tmp_path_factory.mktemp("unused"), extra + overrides + [f"serve.port={free_port()}"])
    promote(cfg, old)
    url = start_serving(cfg)
    try:
        check_promotion_under_load(cfg, url, old, new, 240.0, "vllm")
    finally:
        stop_serving()


def test_drain_and_swap_rollout_with_two_replicas_loses_no_request(registry, tmp_path_factory):
    """serve.rollout=drain_and_swap (one engine per replica, as on a GPU that holds one copy of the target): each
    replica drains and swaps in turn while the other answers; promotion under load, then rollback under load."""
    from draftline.registry import alias_version_number, promote
    from draftline.release import promote_and_roll, rollback_and_roll

    extra, old, new = registry
    cfg = mlflow_test_config(tmp_path_factory.mktemp("unused"), extra + [
        f"serve.port={free_port()}", "serve.rollout=drain_and_swap", "serve.num_replicas=2", "serve.cpus_per_replica=0.5"])
    promote(cfg, old)
    url = start_serving(cfg)
    try:
        with under_load(url) as results:
            wait_for_answers(results, CLIENTS)
            started = time.monotonic()
            promote_and_roll(cfg, new)
            promoted_s = time.monotonic() - started
            wait_for_answers(results, CLIENTS, after=started + promoted_s)
            started = time.monotonic()
            rollback_and_roll(cfg)
            rolled_back_s = time.monotonic() - started
            wait_for_answers(results, CLIENTS, after=started + rolled_back_s)
    finally:
        stop_serving()
    failures, versions = outcomes(results)
    slowest_s = max(end - start for start, end, _ in results)
    print(f"drain_and_swap, 2 replicas: {len(results)} requests, {len(failures)} failed, versions {dict(versions)}, "
          f"promotion {promoted_s:.1f} s, rollback {rolled_back_s:.1f} s, slowest request {slowest_s:.1f} s")
    assert failures == []
    assert versions[old] > 0 and versions[new] > 0
    assert alias_version_number(cfg) == old


def test_blue_green_rollout_switches_sets_and_a_failed_set_changes_nothing(registry, tiny_target_dir, tmp_path_factory):
    """serve.rollout=blue_green, 2 replicas per set, under load: promotion brings up a second set with the new version
    beside the old one, switches the ingress when all its replicas serve it, then the old set drains and is deleted;
    0 requests fail and every request started after the promotion returned gets the new version. Then a version
    whose engine cannot start: its set fails, is deleted, the serving set and the registry stay as they were."""
    from draftline.registry import alias_version_number, promote
    from draftline.release import ReleaseError, promote_and_roll
    from draftline.serving.app import ENGINE_APPS
    from draftline.serving.control import active_engine_app, engine_replicas

    extra, old, new = registry
    cfg = mlflow_test_config(tmp_path_factory.mktemp("unused"), extra + [
        f"serve.port={free_port()}", "serve.rollout=blue_green", "serve.num_replicas=2", "serve.cpus_per_replica=0.5"])
    broken = register_drafter(cfg, random_drafter(tiny_target_dir, seed=4), {GATE_TAG: "passed"},
                              damage=_config_that_does_not_fit_its_weights)
    promote(cfg, old)
    url = start_serving(cfg)
    try:
        blue = {r["replica_id"] for r in engine_replicas()}
        assert active_engine_app() == ENGINE_APPS[0] and len(blue) == 2
        with under_load(url, max_s=1200) as results:
            wait_for_answers(results, CLIENTS)
            started = time.monotonic()
            promote_and_roll(cfg, new)
            rolled_at = time.monotonic()
            wait_for_answers(results, CLIENTS, after=rolled_at)
        assert active_engine_app() == ENGINE_APPS[1] and not engine_replicas(ENGINE_APPS[0])
        green = {r["replica_id"] for r in engine_replicas()}
        assert len(green) == 2 and not green & blue
        champion, previous = alias_version_number(cfg), alias_version_number(cfg, "previous")
        with under_load(url, max_s=1200) as failed_roll_results:
            wait_for_answers(failed_roll_results, CLIENTS)
            failing_started = time.monotonic()
            with pytest.raises(ReleaseError, match=rf"did not roll to .*version {broken}.*back on version {new}.*registry is unchanged"):
                promote_and_roll(cfg, broken)
            failing_s = time.monotonic() - failing_started
            wait_for_answers(failed_roll_results, CLIENTS, after=failing_started + failing_s)
        assert (alias_version_number(cfg), alias_version_number(cfg, "previous")) == (champion, previous) == (new, old)
        assert active_engine_app() == ENGINE_APPS[1] and {r["replica_id"] for r in engine_replicas()} == green
        assert not engine_replicas(ENGINE_APPS[0])  # the failed set was deleted
    finally:
        stop_serving()
    failures, versions = outcomes(results)
    late = Counter(outcome for start, _, outcome in results if start > rolled_at)
    failed_roll_failures, failed_roll_versions = outcomes(failed_roll_results)
    print(f"blue_green, 2 replicas per set: {len(results)} requests, {len(failures)} failed, versions {dict(versions)}, "
          f"promotion {rolled_at - started:.1f} s, slowest request {max(e - s for s, e, _ in results):.1f} s, started "
          f"after it: {dict(late)}; failed roll to {broken}: {len(failed_roll_results)} requests, "
          f"{len(failed_roll_failures)} failed, versions {dict(failed_roll_versions)}, refused after {failing_s:.1f} s "
          f"(load {open('/proc/loadavg').read().split()[:3]})")
    assert failures == [] and failed_roll_failures == []
    assert versions[old] > 0 and versions[new] > 0
    assert late and set(late) == {new}, "a request started after the switch was answered by the old set"
    assert set(failed_roll_versions) == {new}
