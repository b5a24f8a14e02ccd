"""What a pipeline driver does differently when it runs as a Ray job (`ray job submit --working-dir .`)."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, make_test_config
from draftline.pipeline import relative_data_dir_in_ray_job
from draftline.raycluster import code_runtime_env

JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def _job(monkeypatch, runtime_env: dict) -> None:
    monkeypatch.setenv(JOB_ENV, json.dumps({"runtime_env": runtime_env, "metadata": {}}))


def test_the_driver_ships_its_own_package_to_the_workers(monkeypatch):
    monkeypatch.delenv(JOB_ENV, raising=False)
    shipped = code_runtime_env()["py_modules"]
    assert shipped == [str(REPO / "platform" / "draftline")]
    _job(monkeypatch, {"working_dir": "gcs://_ray_pkg_x.zip"})
    assert code_runtime_env()["py_modules"] == shipped


def test_a_job_with_its_own_py_modules_is_left_alone(monkeypatch):
    _job(monkeypatch, {"working_dir": "gcs://_ray_pkg_x.zip", "py_modules": ["gcs://_ray_pkg_y.zip"]})
    assert code_runtime_env() == {}


@pytest.mark.parametrize(
    "data_dir, runtime_env, warns",
    [
        ("./.draftline", {"working_dir": "gcs://_ray_pkg_x.zip"}, True),
        ("/mnt/shared/draftline", {"working_dir": "gcs://_ray_pkg_x.zip"}, False),
        ("./.draftline", {}, False),
        ("./.draftline", None, False),
    ],
)
def test_relative_data_dir_inside_a_ray_job_is_warned_about(monkeypatch, data_dir, runtime_env, warns):
    if runtime_env is None:
        monkeypatch.delenv(JOB_ENV, raising=False)
    else:
        _job(monkeypatch, runtime_env)
    warning = relative_data_dir_in_ray_job(make_test_config(data_dir))
    assert bool(warning) is warns
    if warns:
        assert "data_dir './.draftline' is relative" in warning and "data_dir=/absolute/path" in warning
