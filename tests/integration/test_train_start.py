"""A training worker group the cluster cannot fit fails within train.start_timeout_s, naming what it waited for,
instead of waiting forever (Ray Train retries a start that timed out as a controller failure, by default forever)."""

from __future__ import annotations

import pytest

from conftest import make_test_config
from draftline.train.run import WorkerStartTimeoutError, _run_workers


def test_workers_the_cluster_cannot_fit_fail_at_the_deadline_naming_the_resources(ray_cluster, tmp_path):
    cfg = make_test_config(tmp_path, ["train.cpus_per_worker=64", "train.start_timeout_s=3", "train.max_failures=1"])
    with pytest.raises(WorkerStartTimeoutError) as raised:
        _run_workers(cfg, {}, run_name="never-starts")
    message = str(raised.value)
    assert "waited 3 s (train.start_timeout_s), 2 time(s), for 2 worker(s) of {'CPU': 64.0} each" in message, message
    assert "the cluster has {'CPU': " in message and "raise train.start_timeout_s" in message
