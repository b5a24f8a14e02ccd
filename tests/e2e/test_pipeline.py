"""The whole embedded pipeline, as a user runs it.

First run: `ray job submit --working-dir . -- python jobs/pipeline.py --config configs/tiny-cpu.yaml` against a Ray
cluster this test starts with `ray start --head` (token auth on, as on a real cluster: `ray start` listens on every
interface), with sqlite MLflow, DeepSpeed training on 2 Ray Train workers, the gate, promotion and a served chat
completion. The Serve app must outlive the job, and the report's serving line must match a real request. Reruns on
the same data dir (issue 19: a record of having served says nothing about now): the same job on the same live
cluster skips every stage, serve included; `draftline run` with its own local Ray fails clearly while that cluster
holds serve.port; once the cluster is stopped, it serves again instead of skipping, and reports that its local Ray
(and the endpoint) ends with the run. Thresholds are the issues' (val acc_0 >= 0.6, est accept length >= 2.0).

The embedded target is the tests' size (conftest.TEST_OVERRIDES: 8 layers, hidden 96, 150 LM steps), built once per
test session (the tiny_target_dir fixture, whose build tests/unit/test_bootstrap.py checks) and copied into the job's
data dir, where the job's bootstrap stage finds it by content hash, as a user's rerun does; every later stage runs
from scratch. The default size (hidden 160, 400 LM steps) is what `make demo` runs, timed in benchmarks/RESULTS.md.

Wall-clock speed is a benchmark (benchmarks/RESULTS.md), not a test assertion: the gate's min_speedup is relaxed to
0.2 here (conftest.PIPELINE_TEST_MIN_SPEEDUP: a gross regression still fails) and the gate runs two paired rounds (one
look) instead of up to nine, while accept length, losslessness and the gate's decision are asserted.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from draftline.utils import read_json
from conftest import PIPELINE_TEST_MIN_SPEEDUP, REPO, TEST_OVERRIDES, free_port


VENV_BIN = os.path.dirname(sys.executable)
CONFIG = "configs/tiny-cpu.yaml"


def _wait_dashboard(url: str, headers: dict, proc: subprocess.Popen, log_path: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ray start exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            if httpx.get(f"{url}/api/version", headers=headers, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"the Ray dashboard at {url} did not come up:\n{open(log_path).read()[-4000:]}")


@pytest.fixture(scope="module")
def submit_cluster():
    """A Ray head started the way a user starts one (`ray start --head --block`), on free ports, with token auth.

    The token lives in the environment of this cluster and of the `ray job submit` calls only (RAY_AUTH_TOKEN), so
    no per-user ~/.ray/auth_token is written or shared. Stopped with SIGTERM to `ray start --block`, which stops
    exactly this cluster's processes (`ray stop` would stop every Ray cluster of the user, this session's too).
    """
    temp_dir = tempfile.mkdtemp(prefix="dl-ray-", dir="/tmp")  # short: Ray's unix socket paths have a length limit
    dashboard_port = free_port()
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PATH=VENV_BIN + os.pathsep + env.get("PATH", ""), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token,
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="5")  # a test cluster: nothing to drain for 30 s at the end
    ports = {"--port": free_port(), "--ray-client-server-port": free_port(), "--dashboard-agent-listen-port": free_port(),
             "--dashboard-agent-grpc-port": free_port(), "--runtime-env-agent-port": free_port(),
             "--metrics-export-port": free_port(), "--dashboard-port": dashboard_port}  # fmt: skip
    cmd = [os.path.join(VENV_BIN, "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           "--dashboard-host=127.0.0.1", "--num-cpus=4", f"--temp-dir={temp_dir}", "--disable-usage-stats",
           *[f"{flag}={port}" for flag, port in ports.items()]]  # fmt: skip
    log_path = os.path.join(temp_dir, "ray-start.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard_port}"

    def stop() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)

    try:
        _wait_dashboard(url, {"Authorization": f"Bearer {token}"}, proc, log_path)
        session = os.path.basename(os.path.realpath(os.path.join(temp_dir, "session_latest")))
        yield {"url": url, "env": env, "gcs_port": ports["--port"], "session": session, "stop": stop}
    finally:
        stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _submit(cluster, *args, env=None, timeout=1500) -> subprocess.CompletedProcess:
    cmd = [os.path.join(VENV_BIN, "ray"), "job", "submit", "--address", cluster["url"], "--working-dir", str(REPO),
           "--", "python", *args]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=env or cluster["env"], capture_output=True, text=True, timeout=timeout)


MIN_SPEEDUP = PIPELINE_TEST_MIN_SPEEDUP  # conftest: why the floor is this low


def _pipeline_args(data_dir, port) -> list[str]:
    # 50 training steps (one val pass), not the demo's 300: on the tests' target val acc_0 was 0.75 at step 50 and 1.0
    # from step 100 on (est accept length 4.1, then 8.0); step 50 is past this test's thresholds, and every later step
    # costs seconds at load without testing anything more.
    return ["--config", CONFIG, *TEST_OVERRIDES, f"data_dir={data_dir}", f"serve.port={port}", f"gate.min_speedup={MIN_SPEEDUP}",
            "gate.min_rounds=2", "gate.max_rounds=2", "train.max_steps=50"]  # fmt: skip


def test_job_submit_without_the_token_is_refused(submit_cluster):
    env = {k: v for k, v in submit_cluster["env"].items() if k != "RAY_AUTH_TOKEN"}
    refused = _submit(submit_cluster, "-c", "print('ran')", env=env, timeout=120)
    assert refused.returncode != 0
    assert "ran" not in refused.stdout
    assert "AuthenticationError" in refused.stdout + refused.stderr


def _report_serving(root: str) -> str:
    rows = [line for line in open(os.path.join(root, "report.md")) if line.startswith("| serving | ")]
    assert len(rows) == 1, rows
    return rows[0].strip()


def _assert_report_matches_endpoint(root: str, cluster: dict) -> str:
    """The report's serving line against a real request: same URL, model and version, and the cluster's address."""
    line = _report_serving(root)
    found = re.match(r"\| serving \| yes: (\S+)/v1 serves (\S+) version (\S+) from Ray cluster (\S+),", line)
    assert found, line
    url, model, version, ray_address = found.groups()
    assert ray_address.endswith(f":{cluster['gcs_port']}"), line
    models = httpx.get(f"{url}/v1/models", timeout=30)
    assert models.status_code == 200, models.text
    answered = models.json()["data"][0]["draftline"]
    assert (answered["registered_model"], answered["model_version"]) == (model, version), (line, answered)
    return version


def _refused(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
    except httpx.ConnectError:
        return True
    return False


def test_tiny_pipeline_as_a_ray_job_then_reruns(submit_cluster, tiny_target_dir, tmp_path):
    data_dir = os.environ.get("DRAFTLINE_E2E_DATA_DIR", str(tmp_path / "data"))
    shutil.copytree(tiny_target_dir, os.path.join(data_dir, "targets", tiny_target_dir.name), dirs_exist_ok=True)
    # The same port every time: serve.port is part of the serve stage's inputs, so a new port would rerun it.
    port = free_port()
    first = _submit(submit_cluster, "jobs/pipeline.py", *_pipeline_args(data_dir, port))
    assert first.returncode == 0, first.stdout[-6000:] + first.stderr[-3000:]
    assert "succeeded" in first.stdout + first.stderr
    root = os.path.join(data_dir, "pipeline", "tiny-cpu")
    summary = read_json(os.path.join(root, "summary.json"))
    assert set(summary) == {"bootstrap", "prepare", "extract", "train", "gate", "promote", "serve"}
    assert all(stage["status"] == "ran" for stage in summary.values()), summary

    boot = summary["bootstrap"]["outputs"]
    assert boot["heldout_perplexity"] < boot["uniform_perplexity"] / 20

    val = summary["train"]["outputs"]["metrics"]
    assert val["val_acc_0"] >= 0.6, val
    assert val["val_est_accept_len"] >= 2.0, val

    gate = summary["gate"]["outputs"]
    assert gate["passed"], gate["reasons"]
    assert gate["bench"]["lossless"] is True
    assert gate["bench"]["accept_length"] > 1.5
    assert gate["rounds"] == 2 and gate["verdict"] == "passed"
    low, high = gate["intervals"]["speedup@1"]
    assert MIN_SPEEDUP <= low <= gate["bench"]["speedup"] <= high  # passed = the interval's lower bound clears the floor
    assert gate["machine_load"]["cpu_count"] >= 1
    assert summary["promote"]["outputs"] == {"promoted": True, "version": gate["version"]}

    served = summary["serve"]["outputs"]
    assert served["version"] == str(gate["version"]) and served["completion"].strip()
    serving = summary["serve"]["serving"]
    assert serving["serving"] and serving["ray_session"] == submit_cluster["session"], serving

    # The job has ended; the Serve app it deployed keeps serving the champion from the cluster, as the report says.
    assert _assert_report_matches_endpoint(root, submit_cluster) == str(gate["version"])
    chat = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
        "model": serving["registered_model"], "max_tokens": 8,
        "messages": [{"role": "user", "content": "Return the length of a list."}]})  # fmt: skip
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"].strip()

    report = open(os.path.join(root, "report.md")).read()
    assert "gate verdict | passed" in report
    for stage in summary:
        assert os.path.getsize(os.path.join(root, "logs", f"{stage}.log")) > 0

    # Second run: the same job on the same live cluster. Every stage is skipped, serve too: its endpoint answers.
    second = _submit(submit_cluster, "jobs/pipeline.py", *_pipeline_args(data_dir, port), timeout=600)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-3000:]
    rerun = read_json(os.path.join(root, "summary.json"))
    assert {name: s["status"] for name, s in rerun.items()} == {name: "skipped" for name in summary}
    assert _assert_report_matches_endpoint(root, submit_cluster) == str(gate["version"])

    # Third run: `draftline run` with its own local Ray while that cluster still holds the port: a clear error.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}

    def run_locally() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "draftline.cli", "run", *_pipeline_args(data_dir, port)],
                              cwd=REPO, env={**env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                              timeout=600)  # fmt: skip

    clash = run_locally()
    assert clash.returncode != 0
    assert f"serve.port {port} on 127.0.0.1 is already taken by a draftline endpoint serving" in clash.stderr, \
        clash.stdout[-3000:] + clash.stderr[-3000:]

    # The cluster goes away, as the local Ray of `make demo` does when it exits: nothing answers any more.
    submit_cluster["stop"]()
    assert _refused(port)
    # Fourth run, again with its own local Ray: serve runs again instead of skipping. That Ray stops when the
    # run ends, and the report says so, with the command that keeps an endpoint up.
    fourth = run_locally()
    assert fourth.returncode == 0, fourth.stdout[-4000:] + fourth.stderr[-4000:]
    last = read_json(os.path.join(root, "summary.json"))
    assert {name: s["status"] for name, s in last.items()} == {**{name: "skipped" for name in summary}, "serve": "ran"}
    assert last["serve"]["outputs"]["version"] == str(gate["version"])
    serving = last["serve"]["serving"]
    assert not serving["serving"], serving
    assert serving["start_command"].startswith("draftline serve --config configs/tiny-cpu.yaml"), serving
    assert _report_serving(root).startswith("| serving | no: the local Ray cluster this run started stops"), \
        _report_serving(root)
    assert "endpoint: no: " in fourth.stdout
    assert _refused(port)
