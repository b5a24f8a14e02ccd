"""The `draftline` command line: options and KEY=VALUE overrides parse independently of their order."""

import pytest

from draftline.bench.cli import apply_bench_overrides
from draftline.cli import build_parser
from draftline.config import ConfigError, load_config


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
