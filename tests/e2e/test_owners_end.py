"""Every process a draftline command starts goes when its owner goes, whatever ends it. Each command runs for real
as a subprocess, with vLLM's CPU build (.venv-vllm) as its engine; once a vLLM server is up (its API server answers
/health, with its EngineCore, Worker and resource tracker), its owner is ended by a signal, and within a deadline no
process it started may be left: those recorded below it, every process carrying the mark the command was started
with (process_helpers), and the reapers of its servers.

Before the fix, SIGTERM to `draftline bench --engine vllm` left EngineCore and Worker running for 10 minutes,
reparented to init: they write their title over their environment, and PR_SET_PDEATHSIG (SIGKILL) was set on the API
server only, so they never heard of its end. One vLLM start per command, so each test combines what one start can
check, and the signals are spread over the commands:
  bench       SIGTERM to the command, the server's owner (no handler: it dies at once, as with SIGKILL)
  gate        SIGKILL to the command, the server's owner (the OOM killer's signal: no handler can run)
  regenerate  SIGKILL to the replica actor that owns the server, then Ctrl-C (SIGINT to the process group) to the
              command, which stops its local Ray
  serve       SIGKILL to the Serve replica that owns the server, then SIGTERM to the command
A replica's server must go with the replica, before the command ends; then nothing of the command may be left. (Ended
by the command's Ray, the replicas' servers got SIGTERM from Ray's own local-cluster reaper and shut their engines down
themselves: that path left nothing before the fix either.) The same for a stand-in server, with every signal and an
orderly stop, in seconds: tests/integration/test_server_reaper.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from conftest import REPO, TEST_CONFIG, VLLM_TEST_OVERRIDES, config_overrides, free_port, make_test_config
from process_helpers import (
    Owner, cmdline, descendants, live_pids, marked, parent_pid, start_time, wait_all_gone, wait_for,
)
from registry_helpers import mlflow_overrides

from draftline.regenerate.run import REPLICA_STOP_TIMEOUT_S

# A vLLM start-up took 222 s at load 25 (benchmarks/RESULTS.md), 7 min at load 45 (this module, before a signal).
pytestmark = pytest.mark.timeout(1200)

VLLM_UP_S = 720.0
GONE_S = 60.0
# The command's own exit after its signal: its replicas' engines get REPLICA_STOP_TIMEOUT_S (30 s), then its local Ray
# stops. At load 30-55 that took more than 60 s (the regenerate test, full suite beside a real-target training run).
OWNER_EXIT_S = REPLICA_STOP_TIMEOUT_S + 120.0
VLLM_TITLES = ("VLLM::EngineCore", "VLLM::Worker")


def vllm_server_up(owner: Owner) -> int | None:
    """The pid of a vLLM API server the owner started, once it answers /health with its EngineCore and Worker below
    it. (Ended while still starting, vLLM's engine processes sometimes noticed and exited by themselves; started, they
    stayed for good.)"""
    for pid in marked(owner.mark):
        argv = cmdline(pid).split(" ")
        if "vllm.entrypoints.openai.api_server" in argv and healthy(argv[argv.index("--port") + 1]):
            below = {cmdline(child) for child in descendants(pid)}
            if all(any(title.startswith(t) for title in below) for t in VLLM_TITLES):
                return pid
    return None


def healthy(port: str) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def reapers_of(pids) -> dict[int, int]:
    """{pid: start time} of the server reapers (draftline/reaper.py) of the processes `pids`."""
    owners = {f"reaper.py servers {pid}-" for pid in pids}
    return {pid: start_time(pid) for pid in live_pids() if any(o in cmdline(pid) for o in owners)}


def start_owner(argv: list[str], log: Path) -> tuple[Owner, int, dict[int, int]]:
    """The command, once its vLLM server is up -> (owner, API server pid, {pid: start time} of the server's tree)."""
    owner = Owner.start([sys.executable, "-m", "draftline.cli", *argv], log, cwd=REPO)
    server = wait_for("vLLM API server with its EngineCore and Worker", lambda: vllm_server_up(owner), VLLM_UP_S, owner)
    tree = {pid: start_time(pid) for pid in (server, *descendants(server))}
    reapers = reapers_of([parent_pid(server)])
    assert reapers, "no reaper watches the vLLM server"
    return owner, server, {**tree, **reapers}


def end_and_check(owner: Owner, sig: signal.Signals, what: str) -> None:
    """Send `sig` to the command; then nothing it started may be left."""
    recorded = owner.tree()
    recorded.update(reapers_of(recorded))
    owner.send(sig)
    owner.process.wait(timeout=OWNER_EXIT_S)
    seconds = wait_all_gone(recorded, owner.mark, GONE_S)
    print(f"{what}, then {sig.name} to the command: its {len(recorded)} processes gone {seconds:.1f} s after it")


def check_command_owner(argv: list[str], sig: signal.Signals, log: Path) -> None:
    """The command owns the server (bench, gate: the engines run in the command's own process)."""
    owner, server, tree = start_owner(argv, log)
    try:
        assert parent_pid(server) == owner.process.pid
        end_and_check(owner, sig, f"{argv[0]}: vLLM tree {sorted(cmdline(pid)[:40] for pid in tree)}")
    finally:
        print(f"the owner's output:\n{owner.output()[-3000:]}")  # shown with a failure


def check_replica_owner(argv: list[str], sig: signal.Signals, log: Path) -> None:
    """A Ray actor of the command owns the server (regenerate and Serve replicas): SIGKILL it first."""
    owner, server, tree = start_owner(argv, log)
    try:
        replica = parent_pid(server)
        assert replica != owner.process.pid and replica in owner.tree()
        os.kill(replica, signal.SIGKILL)
        seconds = wait_all_gone(tree, None, GONE_S)
        end_and_check(owner, sig, f"{argv[0]}: replica {replica} SIGKILLed, its vLLM tree gone {seconds:.1f} s after")
    finally:
        print(f"the owner's output:\n{owner.output()[-3000:]}")  # shown with a failure


@pytest.fixture(scope="module")
def registry_overrides(tmp_path_factory, fitted_drafter_dir) -> list[str]:
    """A test-local MLflow store whose champion is the fitted drafter (gate-passed)."""
    from draftline.registry import promote
    from draftline.tracking import GATE_TAG
    from registry_helpers import register_export_dir

    overrides = mlflow_overrides(tmp_path_factory.mktemp("mlflow"))
    cfg = make_test_config(extra=overrides)
    promote(cfg, register_export_dir(cfg, fitted_drafter_dir, {GATE_TAG: "passed"}))
    return overrides


def config_args(extra: list[str]) -> list[str]:
    return ["--config", str(TEST_CONFIG), *config_overrides(extra=VLLM_TEST_OVERRIDES + extra)]


def test_bench_ended_by_sigterm_leaves_nothing(tmp_path, fitted_drafter_dir, tiny_dataset_dir):
    check_command_owner(["bench", "--drafter", str(fitted_drafter_dir), "--concurrency", "1", *config_args([])],
                        signal.SIGTERM, tmp_path / "bench.log")


def test_gate_ended_by_sigkill_leaves_nothing(tmp_path, registry_overrides, tiny_dataset_dir):
    check_command_owner(["gate", "--version", "1", *config_args(registry_overrides)], signal.SIGKILL,
                        tmp_path / "gate.log")


def test_a_killed_regenerate_replica_and_then_ctrl_c_leave_nothing(tmp_path, tiny_target_dir):
    """The target's 200 conversations three times over, under ids of this run's own (so no earlier output is reused):
    minutes of regeneration, so the server is still at work when the test has seen it up."""
    run = uuid.uuid4().hex[:8]
    conversations = [json.loads(line) for line in (tiny_target_dir / "conversations.jsonl").read_text().splitlines()]
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps({**c, "id": f"{c['id']}-{copy}-{run}"}) + "\n"
                              for copy in range(3) for c in conversations))
    check_replica_owner(["regenerate", *config_args([f"data.conversations={source}"])], signal.SIGINT,
                        tmp_path / "regenerate.log")


def test_a_killed_serve_replica_and_then_sigterm_leave_nothing(tmp_path, registry_overrides):
    check_replica_owner(["serve", *config_args([*registry_overrides, f"serve.port={free_port()}"])], signal.SIGTERM,
                        tmp_path / "serve.log")
