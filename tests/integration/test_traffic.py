"""Traffic capture and the drift check through the real Serve endpoint (local Ray, Serve on 127.0.0.1, MLflow and
the traffic store in a tmp dir, the reference engine on the test target).

One app for the module: a registered, promoted, randomly initialised drafter (its accept length is about 1), capture
on with every request sampled, a drift window of 3 requests, and a drift starting the refresh as a Ray job. The
gate's accept length is written to the version's gate run the way `draftline gate` writes it (an `accept_length`
metric per benched concurrency, the run named by the version's gate_run_id tag) instead of running the gate's bench,
which would add minutes.
"""

from __future__ import annotations

import asyncio
import json
import re
import stat
import time

import httpx
import mlflow
import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from conftest import free_port
from draftline.serving.control import capture_replicas
from draftline.serving.refresh_job import refresh_submission_id
from draftline.serving.traffic_capture import TrafficCapture
from draftline.serving.traffic_store import read_records, shard_paths, traffic_dir
from draftline.tracking import (
    DRIFT_DETAIL_TAG,
    DRIFT_TAG,
    GATE_RUN_TAG,
    GATE_TAG,
    REFRESH_JOB_TAG,
    mlflow_client,
    setup_mlflow,
)
from registry_helpers import mlflow_test_config, random_drafter, register_drafter
from serve_helpers import start_serving, stop_serving

GATE_ACCEPT_LENGTH = 3.0
# Above what the module captures: the refresh job a drift starts stops at its first check, having trained nothing.
REFRESH_MIN_RECORDS = 1000
SEGMENT_HEADER = "x-draftline-segment"


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory, tiny_target_dir):
    from draftline.registry import promote

    tmp_path = tmp_path_factory.mktemp("traffic")
    cfg = mlflow_test_config(tmp_path, [
        f"serve.port={free_port()}", "serve.max_tokens_limit=16", "serve.traffic.enabled=true",
        f"serve.traffic.dir={tmp_path / 'traffic'}", "serve.drift.window_requests=3", "serve.drift.margin=0.2",
        "serve.drift.refresh=true", f"refresh.min_records={REFRESH_MIN_RECORDS}",
    ])
    version = register_drafter(cfg, random_drafter(tiny_target_dir, seed=1), {GATE_TAG: "passed"})
    setup_mlflow(cfg)
    with mlflow.start_run(run_name=f"gate-v{version}") as run:
        mlflow.log_metric("accept_length", GATE_ACCEPT_LENGTH, step=1)
    mlflow_client(cfg).set_model_version_tag(cfg.registered_model_name, version, GATE_RUN_TAG, run.info.run_id)
    promote(cfg, version)
    url = start_serving(cfg)
    yield cfg, url, version
    stop_serving()


async def _burst(url: str, count: int, segment: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=180) as http:
        return await asyncio.gather(*(
            http.post(f"{url}/v1/chat/completions", headers={SEGMENT_HEADER: segment},
                      json={"messages": [{"role": "user", "content": f"{segment} request {i}: name a list method."}],
                            "max_tokens": 8, "temperature": 0})
            for i in range(count)
        ))


def _records_by_id(cfg, wanted: set[str], timeout_s: float = 60) -> dict[str, dict]:
    """The stored records, once every id in `wanted` is there (or the deadline passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = {r["id"]: r for r in read_records(traffic_dir(cfg))}
        if wanted <= set(records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def _exported_counter(name: str, labels: str, at_least: float, timeout_s: float = 60) -> float:
    """A counter's value on the Ray metrics port (Ray exports with a delay): once it reaches `at_least`, or the last."""
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    pattern = re.compile(rf"^ray_{name}_total\{{[^}}]*{re.escape(labels)}[^}}]*\}} ([0-9.e+]+)$", re.M)
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        value = sum(float(v) for v in pattern.findall(text))
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(2)


def test_capture_under_load_answers_and_records_every_request(served):
    cfg, url, version = served
    responses = asyncio.run(_burst(url, 16, "load"))
    assert [r.status_code for r in responses] == [200] * 16, [r.text[:200] for r in responses if r.status_code != 200]
    answers = {r.json()["id"]: r.json() for r in responses}
    records = _records_by_id(cfg, set(answers))
    missing = set(answers) - set(records)
    assert not missing, f"{len(missing)} of 16 answered requests were not recorded"
    for request_id, answer in answers.items():
        record = records[request_id]
        assert record["model_version"] == version and record["segment"] == "load" and record["route"] == "chat"
        assert record["messages"][0]["content"].startswith("load request ")
        assert record["prompt_token_ids"] and len(record["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]
        assert len(record["completion_token_ids"]) == answer["usage"]["completion_tokens"]
        assert record["completion_text"] == answer["choices"][0]["message"]["content"]
        assert record["sampling"]["temperature"] == 0 and record["sampling"]["max_new_tokens"] == 8
        assert record["spec"]["accept_length"] == pytest.approx(answer["usage"]["spec_accept_length"], abs=1e-3)
    directory = traffic_dir(cfg)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in shard_paths(directory)} == {0o600}
    mlflow_files = [p for p in (directory.parent / "mlruns").rglob("*") if p.is_file()] + [directory.parent / "mlflow.db"]
    assert not any(b"load request" in p.read_bytes() for p in mlflow_files), "traffic reached MLflow"


def test_a_bad_segment_tag_is_refused(served):
    _, url, _ = served
    response = httpx.post(f"{url}/v1/chat/completions", headers={SEGMENT_HEADER: "no spaces please"}, timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == SEGMENT_HEADER


def test_live_accept_length_below_the_gate_tags_the_version_drift_yes(served):
    cfg, url, version = served
    # Each ingress replica judges its own window of 3: enough requests that both fill theirs after the gate's value
    # arrived (the load test's requests may have come before it).
    assert {r.status_code for r in asyncio.run(_burst(url, 8, "drift"))} == {200}
    client = mlflow_client(cfg)
    deadline = time.monotonic() + 60
    while (tags := client.get_model_version(cfg.registered_model_name, version).tags).get(DRIFT_TAG) != "yes":
        assert time.monotonic() < deadline, f"version {version} was not tagged drift=yes: tags {tags}"
        time.sleep(1)
    detail = json.loads(tags[DRIFT_DETAIL_TAG])
    assert detail["gate_accept_length"] == GATE_ACCEPT_LENGTH and detail["window_requests"] == 3
    assert detail["live_accept_length"] < GATE_ACCEPT_LENGTH * (1 - 0.2)
    assert _exported_counter("draftline_live_verify_steps", 'segment="drift"', at_least=1) >= 1


def test_the_drift_started_the_refresh_as_one_ray_job(served, ray_cluster):
    """serve.drift.refresh: the drift (the test above) submitted `draftline refresh` as a real Ray job to the session
    cluster, once for the version however many ingress replicas saw it drift, and wrote the job's id on the version.
    The job runs the real refresh command on the app's config and traffic store; refresh.min_records is set above
    what the module captures, so it stops at its first check, naming the store (the refresh itself, training
    included, is tests/integration/test_refresh.py)."""
    cfg, _, version = served
    client = mlflow_client(cfg)
    deadline = time.monotonic() + 120
    while not (tags := client.get_model_version(cfg.registered_model_name, version).tags).get(REFRESH_JOB_TAG):
        assert time.monotonic() < deadline, f"version {version} got no {REFRESH_JOB_TAG} tag: tags {tags}"
        time.sleep(1)
    job_id = tags[REFRESH_JOB_TAG]
    assert job_id == refresh_submission_id(cfg, version)
    jobs = JobSubmissionClient(ray_cluster.get_runtime_context().gcs_address)
    deadline = time.monotonic() + 300
    while not (status := jobs.get_job_status(job_id)).is_terminal():
        assert time.monotonic() < deadline, f"Ray job {job_id} still {status} after 300 s"
        time.sleep(2)
    logs = jobs.get_job_logs(job_id)
    assert status == JobStatus.FAILED, logs[-3000:]
    assert f"refresh.min_records is {REFRESH_MIN_RECORDS}" in logs and str(traffic_dir(cfg)) in logs, logs[-3000:]
    assert jobs.get_job_info(job_id).metadata["draftline_version"] == version
    assert _exported_counter("draftline_refresh_jobs", 'outcome="submitted"', at_least=1) == 1


def test_a_killed_capture_actor_fails_no_request_and_loses_no_record_uncounted(served):
    """SIGKILL of the capture replica: every request is answered; Serve starts a new capture actor; each answered
    request is in the store or counted in draftline_traffic_dropped{reason="actor_unavailable"}."""
    import os
    import signal

    cfg, url, _ = served
    dropped_before = _exported_counter("draftline_traffic_dropped", 'reason="actor_unavailable"', at_least=0, timeout_s=0)
    victim = capture_replicas()[0]
    os.kill(victim["pid"], signal.SIGKILL)
    answered: set[str] = set()
    deadline = time.monotonic() + 120
    while True:  # bursts until Serve runs a new capture replica, then one more
        responses = asyncio.run(_burst(url, 4, "outage"))
        assert [r.status_code for r in responses] == [200] * 4, "a request failed while the capture actor was down"
        answered |= {r.json()["id"] for r in responses}
        replicas = capture_replicas()
        if any(r["state"] == "RUNNING" and r["pid"] != victim["pid"] for r in replicas):
            break
        assert time.monotonic() < deadline, f"Serve did not replace the capture replica: {replicas}"
    after = asyncio.run(_burst(url, 4, "after"))
    assert [r.status_code for r in after] == [200] * 4
    after_ids = {r.json()["id"] for r in after}
    records = _records_by_id(cfg, after_ids)
    assert after_ids <= set(records), "requests after the restart were not recorded"
    lost = answered - set(records)
    dropped = _exported_counter("draftline_traffic_dropped", 'reason="actor_unavailable"',
                                at_least=dropped_before + len(lost)) - dropped_before
    print(f"capture actor killed: {len(answered)} requests during the outage, {len(answered) - len(lost)} recorded, "
          f"{len(lost)} lost, {dropped:g} counted as dropped")
    assert dropped >= len(lost), f"{len(lost)} records lost, only {dropped:g} counted as dropped"


def test_a_full_disk_drops_records_and_counts_them(ray_cluster, one_mb_tmpfs, tiny_cfg):
    """The capture actor's class in this process (no Serve) on a real 1 MB tmpfs: ENOSPC drops and counts records,
    append never raises, and writing resumes once there is room."""
    import subprocess

    cfg = tiny_cfg.model_copy(update={"serve": tiny_cfg.serve.model_copy(update={
        "traffic": tiny_cfg.serve.traffic.model_copy(update={"enabled": True, "dir": str(one_mb_tmpfs / "t")})})})
    capture = TrafficCapture.func_or_class(cfg.model_dump(mode="json"))
    record = {"id": "r", "messages": [{"role": "user", "content": "x" * 4000}]}
    written = sum(capture.append([record] * 10) for _ in range(40))  # 400 records of ~4 KB into 1 MB
    dropped = capture._metrics.dropped_by_reason["write_error"]
    assert 0 < written < 400 and written + dropped == 400
    subprocess.run(["mount", "-o", "remount,size=4m", str(one_mb_tmpfs)], check=True)
    assert capture.append([record]) == 1
