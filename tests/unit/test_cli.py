"""The `draftline` command line. Options and KEY=VALUE overrides parse independently of their order. The quiet
console: an error draftline raises on purpose is one line on stderr and a non-zero exit; --debug (or
DRAFTLINE_DEBUG=1) adds the traceback; any other exception is a bug and keeps its traceback."""

from __future__ import annotations

import importlib
import os

import pytest

import draftline.data.cli as prepare_command
from draftline.bench.cli import apply_bench_overrides
from draftline.cli import DEBUG_ENV, EXPECTED_ERRORS, build_parser, main
from draftline.config import ConfigError, load_config
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

    monkeypatch.setattr(prepare_command, "prepare", disk_full)
    assert main(["prepare", "--config", str(TEST_CONFIG), f"data_dir={tmp_path}"]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"


def test_an_unexpected_exception_keeps_its_traceback(monkeypatch, tmp_path):
    def bug(cfg):
        raise KeyError("a bug")

    monkeypatch.setattr(prepare_command, "prepare", bug)
    with pytest.raises(KeyError):
        main(["prepare", "--config", str(TEST_CONFIG), f"data_dir={tmp_path}"])


def test_every_expected_error_name_is_a_real_exception_class():
    for name in EXPECTED_ERRORS:
        module_name, class_name = name.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), class_name)
        assert issubclass(cls, Exception) and f"{cls.__module__}.{cls.__qualname__}" == name


# ------------------------------------------------------------------------------------ options and overrides


def _bench_config(argv: list[str]):
    args = build_parser("bench").parse_args(["bench", *argv])
    return args, apply_bench_overrides(load_config(args.config, args.overrides), args)


def test_overrides_after_concurrency_stay_overrides():
    args, cfg = _bench_config(["--concurrency", "1,4", "bench.rounds=3", "bench.max_new_tokens=7"])
    assert args.concurrency == [1, 4]
    assert cfg.bench.concurrency == [1, 4]
    assert (cfg.bench.rounds, cfg.bench.max_new_tokens) == (3, 7)


def test_single_concurrency_level_then_override():
    _, cfg = _bench_config(["--concurrency", "2", "bench.rounds=3"])
    assert (cfg.bench.concurrency, cfg.bench.rounds) == ([2], 3)


@pytest.mark.parametrize("value", ["1,x", "0", "", "1,,4", "-1"])
def test_bad_concurrency_names_the_flag(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser("bench").parse_args(["bench", "--concurrency", value, "bench.rounds=3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --concurrency" in err and repr(value) in err


def test_space_separated_levels_are_not_taken_as_levels():
    """The old `--concurrency 1 4` form: the 4 is a stray override, reported by the config loader, not a level."""
    args = build_parser("bench").parse_args(["bench", "--concurrency", "1", "4", "bench.rounds=3"])
    assert args.concurrency == [1]
    with pytest.raises(ConfigError, match="override '4'"):
        load_config(args.config, args.overrides)
