"""`draftline` command line. Each stage module registers its own subcommand (a registry, not an if-chain)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from draftline.config import ConfigError, DraftlineConfig, check_data_dir, load_config
from draftline.raycluster import local_ray_stopped_at_the_end
from draftline.stagelog import command_log

# Modules with a `register(subparsers)` function. Imported lazily per command so `--help` stays fast.
COMMAND_MODULES = {
    "bootstrap-target": "draftline.target.cli",
    "regenerate": "draftline.regenerate.cli",
    "prepare": "draftline.data.cli",
    "extract": "draftline.extract.cli",
    "train": "draftline.train.cli",
    "export": "draftline.drafter.cli",
    "bench": "draftline.bench.cli",
    "gate": "draftline.commands.gate",
    "promote": "draftline.commands.release",
    "rollback": "draftline.commands.release",
    "serve": "draftline.serving.cli",
    "traffic": "draftline.commands.traffic",
    "run": "draftline.commands.run",
    "refresh": "draftline.commands.refresh",
    "sglang-command": "draftline.engines.sglang.cli",
    "check-sglang-args": "draftline.engines.sglang.cli",
}


# Errors draftline raises on purpose: their message says what was wrong, where, and the fix, so the console shows
# that line alone (a traceback only with --debug or DRAFTLINE_DEBUG=1). Matched by name along the class's MRO, so
# subclasses count and no module is imported to check. Any other exception is a bug and keeps its traceback.
EXPECTED_ERRORS = frozenset({
    "draftline.config.ConfigError",
    "draftline.data.conversations.DataError",
    "draftline.data.conversations.NoConversationsError",
    "draftline.data.masks.TemplateError",
    "draftline.data.sources.ProvenanceError",
    "draftline.data.vocab.VocabError",
    "draftline.engines.server_process.ServerError",
    "draftline.engines.sglang.preflight.PreflightError",
    "draftline.extract.shards.IncompatibleHiddenStates",
    "draftline.extract.shards.ShardError",
    "draftline.records.RecordError",
    "draftline.refresh.run.RefreshError",
    "draftline.registry.RegistryError",
    "draftline.release.ReleaseError",
    "draftline.serving.control.ServingError",
    "draftline.target.aux_layers.AuxLayerIdError",
    "draftline.train.run.WorkerStartTimeoutError",
    "draftline.utils.LockTimeoutError",
    "draftline.utils.StorageFullError",
})
DEBUG_ENV = "DRAFTLINE_DEBUG"
_debug_flag = False  # --debug on the command line main() is running


def is_expected_error(err: BaseException) -> bool:
    return any(f"{cls.__module__}.{cls.__qualname__}" in EXPECTED_ERRORS for cls in type(err).__mro__)


def debug_enabled() -> bool:
    return _debug_flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def print_error(err: BaseException) -> None:
    """How every command reports an error it handles: `error: <message>` on stderr, after the traceback with --debug."""
    if debug_enabled():
        traceback.print_exception(err)
    print(f"error: {err}", file=sys.stderr, flush=True)


DEFAULT_CONFIG = "configs/tiny-cpu.yaml"


class _ConfigFlag(argparse.Action):
    """--config PATH, remembering that it was given (a config path may also come first among the positionals)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.config_flag = option_string


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", default=DEFAULT_CONFIG, action=_ConfigFlag,
                        help="YAML config (default: %(default)s); or give it first: `draftline run CONFIG [KEY=VALUE ...]`")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.lr=1e-4 data.max_seq_len=512"
    )
    parser.set_defaults(config_flag=None)


def looks_like_config_path(item: str) -> bool:
    return "=" not in item and (item.endswith((".yaml", ".yml")) or os.path.isfile(item))


def take_config_path(args: argparse.Namespace) -> None:
    """`draftline run CONFIG [KEY=VALUE ...]`: a first positional that names a YAML file is the config."""
    overrides = list(getattr(args, "overrides", None) or [])
    if not hasattr(args, "config") or not overrides or not looks_like_config_path(overrides[0]):
        return
    if args.config_flag is not None:
        raise ConfigError(f"two configs: {args.config_flag} {args.config} and {overrides[0]!r}: give one, "
                          f"first (`draftline {args.command} {overrides[0]} ...`) or as {args.config_flag} PATH")
    args.config, args.overrides = overrides[0], overrides[1:]


def config_from_args(args: argparse.Namespace) -> DraftlineConfig:
    cfg = load_config(args.config, list(args.overrides or []))
    check_data_dir(cfg)
    return cfg


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftline", description=__doc__)
    parser.add_argument("--debug", action="store_true",
                        help=f"show the full traceback of an error (also {DEBUG_ENV}=1; allowed anywhere on the line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    seen: set[str] = set()
    for name, module_name in COMMAND_MODULES.items():
        if only is not None and name != only:
            continue
        if module_name in seen:
            continue
        seen.add(module_name)
        importlib.import_module(module_name).register(sub)
    return parser


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Options and KEY=VALUE overrides in any order: argparse takes one run of positionals, so the overrides after
    an option (`run CONFIG --dry-run train.lr=1e-4`) come back unrecognised and join the others, in order."""
    args, extras = parser.parse_known_args(argv)
    unknown_options = [a for a in extras if a.startswith("-")]
    if unknown_options or (extras and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown_options or extras)}")
    if extras:
        args.overrides = [*(args.overrides or []), *extras]
    return args


def main(argv: list[str] | None = None) -> int:
    global _debug_flag
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--debug` may follow the subcommand too (`draftline prepare --debug`); arguments after `--` are passed on.
    end = argv.index("--") if "--" in argv else len(argv)
    _debug_flag = "--debug" in argv[:end]  # read by print_error, here and in the commands
    argv = [a for i, a in enumerate(argv) if not (i < end and a == "--debug")]
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMAND_MODULES else None)
    args = parse_command_line(parser, argv)
    try:
        take_config_path(args)
        # Ray's and other libraries' noise to <data_dir>/logs/<command>.log, Ray's last lines at its shutdown included.
        with command_log(args.command, args), local_ray_stopped_at_the_end():
            return int(args.func(args) or 0)
    except Exception as err:
        if not is_expected_error(err):
            raise
        print_error(err)
        return 2 if isinstance(err, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
