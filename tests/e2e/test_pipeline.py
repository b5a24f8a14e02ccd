"""The whole embedded pipeline, as a user runs it: `draftline run configs/tiny-cpu.yaml`, in its own process with its
own local Ray cluster (127.0.0.1), sqlite MLflow, DeepSpeed training, the gate, promotion and a served chat completion.
A second run must skip every stage. Thresholds are the issues' (val acc_0 >= 0.6, est accept length >= 2.0)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from draftline.utils import read_json
from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(data_dir, port, *extra):
    cmd = [sys.executable, "-m", "draftline.cli", "run", "--config", str(REPO / "configs" / "tiny-cpu.yaml"),
           f"data_dir={data_dir}", f"serve.port={port}", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)


def test_tiny_pipeline_end_to_end_then_everything_skips(tmp_path):
    data_dir = os.environ.get("DRAFTLINE_E2E_DATA_DIR", str(tmp_path / "data"))
    # The same port both times: serve.port is part of the serve stage's inputs, so a new port would rerun it.
    port = _free_port()
    first = _run(data_dir, port)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    root = os.path.join(data_dir, "pipeline", "tiny-cpu")
    summary = read_json(os.path.join(root, "summary.json"))
    assert set(summary) == {"bootstrap", "prepare", "extract", "train", "gate", "promote", "serve"}

    boot = summary["bootstrap"]["outputs"]
    assert boot["heldout_perplexity"] < boot["uniform_perplexity"] / 20

    val = summary["train"]["outputs"]["metrics"]
    assert val["val_acc_0"] >= 0.6, val
    assert val["val_est_accept_len"] >= 2.0, val

    gate = summary["gate"]["outputs"]
    assert gate["passed"], gate["reasons"]
    assert gate["bench"]["lossless"] is True
    assert gate["bench"]["accept_length"] > 1.5
    assert summary["promote"]["outputs"] == {"promoted": True, "version": gate["version"]}

    served = summary["serve"]["outputs"]
    assert served["version"] == str(gate["version"]) and served["completion"].strip()

    report = open(os.path.join(root, "report.md")).read()
    assert "gate verdict | passed" in report and "served URL" in report
    for stage in summary:
        assert os.path.getsize(os.path.join(root, "logs", f"{stage}.log")) > 0

    second = _run(data_dir, port)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    rerun = read_json(os.path.join(root, "summary.json"))
    assert {name: s["status"] for name, s in rerun.items()} == {name: "skipped" for name in summary}
