"""The quiet console: an error draftline raises on purpose is one line on stderr and a non-zero exit; --debug (or
DRAFTLINE_DEBUG=1) adds the traceback; any other exception is a bug and keeps its traceback."""

from __future__ import annotations

import importlib
import os

import pytest

import draftline.data.prepare as prepare_module
from draftline.cli import DEBUG_ENV, EXPECTED_ERRORS, main
from draftline.utils import StorageFullError
from conftest import TEST_CONFIG

BAD_VALUE = ["prepare", "--config", str(TEST_CONFIG), "data.max_seq_len=-3"]


def test_a_bad_config_value_is_one_line_naming_the_field_and_the_fix(capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert main(BAD_VALUE) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: invalid config {TEST_CONFIG} (from a command-line override): data.max_seq_len: "
                            "Input should be greater than or equal to 8\n")
    assert captured.out == ""


@pytest.mark.parametrize("how", ["flag before", "flag after", "env"])
def test_debug_shows_the_traceback_too(capsys, monkeypatch, how):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    if how == "env":
        monkeypatch.setenv(DEBUG_ENV, "1")
    argv = {"flag before": ["--debug", *BAD_VALUE], "flag after": [*BAD_VALUE, "--debug"], "env": BAD_VALUE}[how]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "draftline.config.ConfigError" in err
    assert err.endswith("error: invalid config " + str(TEST_CONFIG) + " (from a command-line override): "
                        "data.max_seq_len: Input should be greater than or equal to 8\n")
    if how != "env":
        assert DEBUG_ENV not in os.environ, "--debug must not leak into the environment of later commands"
        assert main(BAD_VALUE) == 2 and "Traceback" not in capsys.readouterr().err


def test_a_full_disk_is_one_line_and_exit_1(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    message = f"cannot write {tmp_path}/x: No space left on device (0.0 MB free there); free space or point data_dir"

    def disk_full(cfg):
        raise StorageFullError(message)

    monkeypatch.setattr(prepare_module, "prepare", disk_full)
    assert main(["prepare", "--config", str(TEST_CONFIG), f"data_dir={tmp_path}"]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"


def test_an_unexpected_exception_keeps_its_traceback(monkeypatch, tmp_path):
    def bug(cfg):
        raise KeyError("a bug")

    monkeypatch.setattr(prepare_module, "prepare", bug)
    with pytest.raises(KeyError):
        main(["prepare", "--config", str(TEST_CONFIG), f"data_dir={tmp_path}"])


def test_every_expected_error_name_is_a_real_exception_class():
    for name in EXPECTED_ERRORS:
        module_name, class_name = name.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), class_name)
        assert issubclass(cls, Exception) and f"{cls.__module__}.{cls.__qualname__}" == name
