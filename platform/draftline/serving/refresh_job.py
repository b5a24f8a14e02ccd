"""Starting `draftline refresh` as a Ray job when a served version drifted (serve.drift.refresh, docs/refresh.md).

The ingress replica whose drift check fired submits the job to the Ray cluster it runs in, through the cluster's job
server (Ray's JobSubmissionClient), the way `ray job submit` does: `ray job list`, `ray job logs` and the dashboard's
Jobs page show it, `ray job stop` stops it. The job runs `python -m draftline refresh` on the config the app serves
with, with this replica's draftline package (py_modules); its driver joins the cluster, so the training's Ray Train
workers and the rollout of the running app happen there.

Exactly once per version: the submission id is derived from the registry, the registered model and the version,
and Ray's job server refuses a second job with the same id, so of the ingress replicas that see the same drift one
submits and the others find its job. The id is then written on the version (the `refresh_job` tag), which a replica
reads first: a version that drifts again after the app restarted (drift windows live in memory) starts nothing.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import yaml
from ray.job_submission import JobSubmissionClient

import draftline
from draftline.config import DraftlineConfig
from draftline.registry import mark_refresh_job, refresh_job_of
from draftline.serving.traffic_store import traffic_dir
from draftline.utils import atomic_write_text, stable_hash

logger = logging.getLogger(__name__)

JOB_CONFIG_FILE = "draftline-refresh.yaml"  # in the job's working directory
SUBMITTED = "submitted"
ALREADY_SUBMITTED = "already_submitted"
FAILED = "failed"  # the ingress's outcome when submit_refresh_job raised or ran past its deadline
RETRY_S = 2.0  # between tries while the job server cannot take the job (starting, restarting, unreachable)


class RefreshJobError(RuntimeError):
    """The refresh job could not be submitted before the deadline; the message holds the last error."""


@dataclass(frozen=True)
class RefreshJob:
    submission_id: str
    outcome: str  # SUBMITTED by this call, or ALREADY_SUBMITTED (by another replica, or before)


def refresh_submission_id(cfg: DraftlineConfig, version: str) -> str:
    """One id per registry, model and version: two registries' apps on one cluster may both have a version 1."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", cfg.registered_model_name)
    return f"draftline-refresh-{name}-v{version}-{stable_hash(cfg.mlflow_tracking_uri_shown)[:8]}"


def job_config(cfg: DraftlineConfig) -> dict:
    """The config the job runs with: the app's own, with its data dir and traffic store as this replica resolves
    them (a relative path would otherwise resolve in the job's working directory, not where the store is)."""
    tree = cfg.model_dump(mode="json")
    tree["data_dir"] = str(cfg.data_path())
    tree["serve"]["traffic"]["dir"] = str(traffic_dir(cfg))
    return tree


def job_entrypoint(promote: bool) -> str:
    # This replica's interpreter: the one the cluster's workers run, with draftline's dependencies.
    command = [sys.executable, "-m", "draftline", "refresh", "--config", JOB_CONFIG_FILE]
    return shlex.join(command + ([] if promote else ["--no-promote"]))


def submit_refresh_job(cfg: DraftlineConfig, version: str, deadline_s: float) -> RefreshJob:
    """Submit the refresh of a drifted version unless one was submitted for it already (blocking: run it off the
    request path). Tries until `deadline_s` (time.monotonic()), then raises RefreshJobError."""
    recorded = refresh_job_of(cfg, version)
    if recorded:
        return RefreshJob(recorded, ALREADY_SUBMITTED)
    submission_id = refresh_submission_id(cfg, version)
    with tempfile.TemporaryDirectory(prefix="draftline-refresh-job-") as working_dir:
        atomic_write_text(Path(working_dir) / JOB_CONFIG_FILE, yaml.safe_dump(job_config(cfg), sort_keys=False),
                          mode=0o600)
        runtime_env = {"working_dir": working_dir, "py_modules": [os.path.dirname(draftline.__file__)],
                       "excludes": ["__pycache__"]}
        metadata = {"draftline_model": cfg.registered_model_name, "draftline_version": version,
                    "started_by": "drift"}
        outcome = _submit_until(submission_id, job_entrypoint(cfg.serve.drift.refresh_promote), runtime_env,
                                metadata, deadline_s)
    # Also when another replica submitted it: the tag stands even if that one stopped before writing it.
    mark_refresh_job(cfg, version, submission_id)
    return RefreshJob(submission_id, outcome)


def _submit_until(submission_id: str, entrypoint: str, runtime_env: dict, metadata: dict, deadline_s: float) -> str:
    last_error: Exception | None = None
    while True:
        client = None
        try:
            # This cluster's job server, found through its GCS (RAY_API_SERVER_ADDRESS / RAY_ADDRESS win, as for
            # `ray job submit`).
            client = JobSubmissionClient(ray.get_runtime_context().gcs_address)
            client.submit_job(entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env,
                              metadata=metadata)
            return SUBMITTED
        except Exception as err:  # noqa: BLE001 - a refusal or an unreachable server: the job's existence tells which
            if client is not None and _job_exists(client, submission_id):
                return ALREADY_SUBMITTED
            last_error = err
        if time.monotonic() + RETRY_S > deadline_s:
            raise RefreshJobError(f"Ray job {submission_id} was not submitted: {last_error}")
        logger.info("refresh job %s not submitted yet (%s); trying again in %.0f s", submission_id, last_error, RETRY_S)
        time.sleep(RETRY_S)


def _job_exists(client, submission_id: str) -> bool:
    try:
        client.get_job_info(submission_id)
    except Exception:  # noqa: BLE001 - not found, or the server not answering: either way no job known to exist
        return False
    return True
