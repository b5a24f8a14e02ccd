"""Every process a draftline command starts goes when the command goes, whatever ends it. Each command runs for real
as a subprocess, with vLLM's CPU build (.venv-vllm) as its engine; once a vLLM server is up (its API server answers
/health, with its EngineCore, Worker and resource tracker) the command is ended by a signal, and within a deadline no process it
started may be left: those recorded below it, every process carrying the mark it was started with (process_helpers),
and the reapers of its servers.

Before the fix, SIGTERM to `draftline bench --engine vllm` left EngineCore and Worker running for 10 minutes,
reparented to init: they write their title over their environment and PR_SET_PDEATHSIG was set on the API server
only. One vLLM start per command, so each command gets one signal, and the three are spread over them:
  bench       SIGTERM   a command with no handler: dies at once (as with SIGKILL)
  gate        SIGKILL   the OOM killer's signal: no handler can run
  regenerate  SIGINT    Ctrl-C, to the command's process group: the driver stops its local Ray, whose workers end
                        their direct children (the vLLM API server) but not the servers' own workers
  serve       SIGKILL   the driver's local-cluster reaper stops the Serve replicas, then their servers must go
The same for a stand-in server, with every signal and an orderly stop, in seconds: tests/integration/
test_server_reaper.py.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import httpx
import pytest

from conftest import REPO, TEST_CONFIG, VLLM_TEST_OVERRIDES, config_overrides, free_port, make_test_config
from process_helpers import Owner, cmdline, descendants, live_pids, marked, start_time, wait_all_gone, wait_for
from registry_helpers import mlflow_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

VLLM_UP_S = 900.0  # a vLLM start-up took 222 s at load 25 (benchmarks/RESULTS.md)
GONE_S = 60.0
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


def end_owner_and_check(argv: list[str], sig: signal.Signals, log: Path) -> None:
    owner = Owner.start([sys.executable, "-m", "draftline.cli", *argv], log, cwd=REPO)
    try:
        server = wait_for("vLLM API server with its EngineCore and Worker", lambda: vllm_server_up(owner), VLLM_UP_S,
                          owner)
        recorded = owner.tree()
        recorded.update(reapers_of(recorded))
        titles = sorted(cmdline(pid).split(" ")[0] for pid in descendants(server))
        assert reapers_of(recorded), "no reaper watches the vLLM server"
        owner.send(sig)
        owner.process.wait(timeout=GONE_S)
        seconds = wait_all_gone(recorded, owner.mark, GONE_S)
        print(f"{argv[0]} ended by {sig.name}: {len(recorded)} processes (vLLM server {server} and {titles} below "
              f"it) gone {seconds:.1f} s after it")
    finally:
        owner.output()


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
    end_owner_and_check(["bench", "--drafter", str(fitted_drafter_dir), "--concurrency", "1", *config_args([])],
                        signal.SIGTERM, tmp_path / "bench.log")


def test_gate_ended_by_sigkill_leaves_nothing(tmp_path, registry_overrides, tiny_dataset_dir):
    end_owner_and_check(["gate", "--version", "1", *config_args(registry_overrides)], signal.SIGKILL,
                        tmp_path / "gate.log")


def test_regenerate_ended_by_ctrl_c_leaves_nothing(tmp_path, tiny_target_dir):
    source = tmp_path / "source.jsonl"
    source.write_text("".join((tiny_target_dir / "conversations.jsonl").read_text().splitlines(True)[:4]))
    end_owner_and_check(["regenerate", *config_args([f"data.conversations={source}",
                                                     "regenerate.max_new_tokens_per_turn=8"])], signal.SIGINT,
                        tmp_path / "regenerate.log")


def test_serve_ended_by_sigkill_leaves_nothing(tmp_path, registry_overrides):
    end_owner_and_check(["serve", *config_args([*registry_overrides, f"serve.port={free_port()}"])], signal.SIGKILL,
                        tmp_path / "serve.log")
