"""What SGLang does with speculative-decoding arguments, per version, as a table; and the rules built on it.

Read from each version's source (never imported, never copied) under /tmp/sgl/<version>/:

Speculative argument handling
- 0.5.6:  sglang/srt/server_args.py `ServerArgs._handle_speculative_decoding`.
- 0.5.12: sglang/srt/server_args.py `ServerArgs._handle_speculative_decoding` (+ `_resolve_speculative_algorithm_alias`).
- 0.5.23: sglang/srt/arg_groups/speculative_hook.py `handle_speculative_decoding` / `_handle_eagle_family`
  (server_args.py only assembles the namespaces; the flags live in sglang/srt/arg_groups/fields/spec.py).

Found in all three (EAGLE, EAGLE3, NEXTN->EAGLE, STANDALONE):
- `--speculative-num-steps` unset: `assert speculative_eagle_topk is None and speculative_num_draft_tokens is None`
  (a bare AssertionError, raised after the target's HF config is read), then the triple is auto-chosen:
  (5, 4, 8) for LlamaForCausalLM in every version; for other architectures (5, 4, 8) in 0.5.6/0.5.12
  (`auto_choose_speculative_params`) but (3, 1, 4) in 0.5.23 (`_auto_choose_speculative_params`).
  0.5.23 skips the assert when `--speculative-adaptive` is given (`_init_adaptive_speculative_params` then sets
  topk=1 and a middle candidate step count); 0.5.12 has `--speculative-adaptive` but still asserts first.
- `--speculative-num-steps` set, `--speculative-eagle-topk` unset: nothing fills topk in, so
  `speculative_eagle_topk > 1` raises `TypeError: '>' not supported between 'NoneType' and 'int'` (the page-size
  check). 0.5.23 with `--speculative-adaptive` sets topk=1 instead.
- topk == 1 and num_draft_tokens != num_steps + 1: a logged warning, and num_draft_tokens is silently set to
  num_steps + 1. With topk > 1 num_draft_tokens is never derived.
- topk > 1 with trtllm_mha as attention/decode/prefill backend: ValueError (0.5.23 checks the resolved backends).
- topk > 1 with page_size > 1: ValueError unless attention_backend is in ("flashinfer", "fa3") in 0.5.6/0.5.12;
  0.5.23 allows ("flashinfer", "fa3", "triton") (`_PAGE_TREE_SPEC_BACKENDS`).
- Algorithm names: 0.5.6 has argparse `choices=["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"]` (case
  sensitive, rejected at parse time). 0.5.12 has no choices; the name is upper-cased and looked up in
  `SpeculativeAlgorithm` (speculative/spec_info.py: DFLASH, EAGLE, EAGLE3, FROZEN_KV_MTP, STANDALONE, NGRAM;
  NEXTN is an alias of EAGLE) or a plugin registry; unknown names raise ValueError late. 0.5.23 adds UNO and
  DSPARK (spec_info.py; NEXTN is in spec_registry.py `_RESERVED_ALIASES`).
Draft checkpoints (sglang/srt/managers/tp_worker.py + configs/model_config.py, all three versions):
- the draft worker loads `speculative_draft_model_path`; `ModelConfig.from_server_args` uses
  `model_path or server_args.model_path`, so with no draft path the *target* is loaded as the draft.
- EAGLE3 draft classes (models/*eagle3*.py `EntryClass`): LlamaForCausalLMEagle3 in 0.5.6; also
  Eagle3DeepseekV2ForCausalLM from 0.5.12. No architecture rewrite for Llama drafts.
- models/llama_eagle3.py: fc input = target_hidden_size (or hidden_size) x 3 in 0.5.6; from 0.5.12
  x len(eagle_config.eagle_aux_hidden_state_layer_ids) (default 3). `d2t` in the weights becomes
  hot_token_id = d2t + arange(len(d2t)), so len(d2t) must equal draft_vocab_size.
- models/llama.py `set_eagle3_layers_to_capture`: ids are shifted by +1 and captured inside
  `for i in range(start_layer, end_layer)`, so an id >= num_hidden_layers - 1 is never captured (the fc then
  gets fewer inputs than it was trained for). Default capture: [2, n//2, n-3].
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

from draftline.config import SpeculativeConfig
from draftline.engines.sglang.args import ArgvItem, FlagTable, ParsedArgv, version_in
from draftline.engines.sglang.checkpoint import CheckpointInfo, read_checkpoint
from draftline.target.aux_layers import AuxLayerIdError, capture_ids_from_written, family_of


# Where SGLang fails, in launch order. An error of the first two phases stops `prepare_server_args` /
# `check_server_args` (and is what SGLang's own checks report); the later ones pass ServerArgs and fail after.
PHASE_TEXT = {
    "parse": "argument parsing",
    "server-args": "ServerArgs validation",
    "load": "model / draft loading (after ServerArgs)",
    "first-draft-step": "the first speculative step (after loading)",
}
SERVER_ARGS_PHASES = ("parse", "server-args")


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning"
    rule: str
    flags: tuple[str, ...]
    message: str
    fix: str
    phase: Optional[str] = None  # a key of PHASE_TEXT (errors); None for warnings
    where: Optional[str] = None  # file:line in SGLang, when SGLang itself raised

    def __str__(self) -> str:
        flags = f" [{', '.join(self.flags)}]" if self.flags else ""
        phase = f" (fails at {PHASE_TEXT.get(self.phase, self.phase)})" if self.phase and self.level == "error" else ""
        where = f"\n  at: {self.where}" if self.where else ""
        return f"{self.level}: {self.rule}{flags}{phase}: {self.message}\n  fix: {self.fix}{where}"


@dataclass(frozen=True)
class VersionBehaviour:
    """How one range of SGLang versions treats speculative arguments (see the module docstring)."""

    checked_version: str  # the version whose source this row was read from
    first_version: str  # inclusive
    before_version: Optional[str]  # exclusive; None = open-ended
    source: str
    algorithm_choices: Optional[tuple[str, ...]]  # argparse choices (case sensitive) or None
    builtin_algorithms: tuple[str, ...]  # accepted after upper-casing (when no argparse choices)
    page_tree_backends: tuple[str, ...]  # allowed attention backends for topk > 1 with page_size > 1
    adaptive_skips_triple_assert: bool
    auto_params_llama: tuple[int, int, int]
    auto_params_other: tuple[int, int, int]
    eagle3_draft_architectures: tuple[str, ...]
    fixed_aux_layer_count: Optional[int]  # 0.5.6's EAGLE3 fc always takes 3 aux states
    reads_draft_config: bool  # ServerArgs reads the draft's config.json (a missing draft path fails there)
    pp_speculative_algorithms: tuple[str, ...]  # what check_server_args allows with --pp-size > 1
    adaptive_candidate_steps: Optional[tuple[int, ...]]  # --speculative-num-steps must be one of them (default config)
    checks_draft_window: bool  # ServerArgs refuses a non-positive --speculative-draft-window-size

    def covers(self, version: str) -> bool:
        return version_in(version, self.first_version, self.before_version)


EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")

# One row per generation of SGLang's argument code (see scripts/setup_sglang_venv.sh for how a release is installed):
# 0.5.6-0.5.9 one ServerArgs.__post_init__; 0.5.10-0.5.12 + --speculative-adaptive; 0.5.13-0.5.19 the speculative
# hook module (arg_groups/speculative_hook.py); 0.5.20+ arg_groups namespaces and resolve_once().
VERSION_TABLE: tuple[VersionBehaviour, ...] = (
    VersionBehaviour(
        checked_version="0.5.6",
        first_version="0.5.6",
        before_version="0.5.10",
        source="sglang/srt/server_args.py ServerArgs._handle_speculative_decoding",
        algorithm_choices=("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"),
        builtin_algorithms=("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"),
        page_tree_backends=("flashinfer", "fa3"),
        adaptive_skips_triple_assert=False,
        auto_params_llama=(5, 4, 8),
        auto_params_other=(5, 4, 8),
        eagle3_draft_architectures=("LlamaForCausalLMEagle3",),
        fixed_aux_layer_count=3,
        reads_draft_config=False,
        pp_speculative_algorithms=(),
        adaptive_candidate_steps=None,
        checks_draft_window=False,
    ),
    VersionBehaviour(
        checked_version="0.5.12",
        first_version="0.5.10",
        before_version="0.5.13",
        source="sglang/srt/server_args.py ServerArgs._handle_speculative_decoding",
        algorithm_choices=None,
        builtin_algorithms=("DFLASH", "EAGLE", "EAGLE3", "FROZEN_KV_MTP", "NEXTN", "NGRAM", "STANDALONE"),
        page_tree_backends=("flashinfer", "fa3"),
        adaptive_skips_triple_assert=False,
        auto_params_llama=(5, 4, 8),
        auto_params_other=(5, 4, 8),
        eagle3_draft_architectures=("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"),
        fixed_aux_layer_count=None,
        reads_draft_config=True,
        pp_speculative_algorithms=(),
        adaptive_candidate_steps=None,
        checks_draft_window=False,
    ),
    VersionBehaviour(
        checked_version="0.5.13",
        first_version="0.5.13",
        before_version="0.5.20",
        source="sglang/srt/arg_groups/speculative_hook.py handle_speculative_decoding",
        algorithm_choices=None,
        builtin_algorithms=("DFLASH", "EAGLE", "EAGLE3", "FROZEN_KV_MTP", "NEXTN", "NGRAM", "STANDALONE"),
        page_tree_backends=("flashinfer", "fa3", "triton"),
        adaptive_skips_triple_assert=False,
        auto_params_llama=(5, 4, 8),
        auto_params_other=(3, 1, 4),
        eagle3_draft_architectures=("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"),
        fixed_aux_layer_count=None,
        reads_draft_config=True,
        pp_speculative_algorithms=(),
        adaptive_candidate_steps=(1, 3, 7),
        checks_draft_window=True,
    ),
    VersionBehaviour(
        checked_version="0.5.23",
        first_version="0.5.20",
        before_version=None,
        source="sglang/srt/arg_groups/speculative_hook.py _handle_eagle_family",
        algorithm_choices=None,
        builtin_algorithms=(
            "DFLASH", "DSPARK", "EAGLE", "EAGLE3", "FROZEN_KV_MTP", "NEXTN", "NGRAM", "STANDALONE", "UNO",
        ),  # fmt: skip
        page_tree_backends=("flashinfer", "fa3", "triton"),
        adaptive_skips_triple_assert=True,
        auto_params_llama=(5, 4, 8),
        auto_params_other=(3, 1, 4),
        eagle3_draft_architectures=("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"),
        fixed_aux_layer_count=None,
        reads_draft_config=True,
        pp_speculative_algorithms=("EAGLE",),
        adaptive_candidate_steps=(0, 1, 3, 5, 7),
        checks_draft_window=True,
    ),
)


def behaviour_for(version: str) -> VersionBehaviour:
    """The row covering `version`; versions older than the table use its first row."""
    for row in VERSION_TABLE:
        if row.covers(version):
            return row
    return VERSION_TABLE[0]


# vLLM option names (vllm serve / EngineArgs) and their SGLang counterparts; None = no SGLang equivalent.
VLLM_EQUIVALENTS: dict[str, Optional[str]] = {
    "--speculative-model": "--speculative-draft-model-path",
    "--speculative-draft-model": "--speculative-draft-model-path",
    "--gpu-memory-utilization": "--mem-fraction-static",
    "--max-model-len": "--context-length",
    "--max-num-seqs": "--max-running-requests",
    "--max-num-batched-tokens": "--chunked-prefill-size",
    "--enforce-eager": "--disable-cuda-graph",
    "--block-size": "--page-size",
    "--pipeline-parallel-size": "--pipeline-parallel-size",
    "--model": "--model-path",
    "--tokenizer": "--tokenizer-path",
    "--speculative-draft-tensor-parallel-size": None,
    "--speculative-disable-by-batch-size": None,
    "--speculative-max-model-len": None,
    "--num-lookahead-slots": None,
}
VLLM_METHODS = {
    "eagle3": "EAGLE3",
    "eagle": "EAGLE",
    "mtp": "NEXTN",
    "deepseek_mtp": "NEXTN",
    "ngram": "NGRAM",
    "draft_model": "STANDALONE",
}


def chain_flags(steps: int | str, topk: int, draft_tokens: int | str) -> str:
    """SGLang's three speculative chain flags (numbers, or placeholders such as "N" and "N+1")."""
    return f"--speculative-num-steps {steps} --speculative-eagle-topk {topk} --speculative-num-draft-tokens {draft_tokens}"


@dataclass(frozen=True)
class MeasuredChain:
    """The speculative settings measured fastest for the drafter being launched (a `draftline bench --sweep` stored
    on its registry version): the fixes propose these rather than a chain length read off the command, whose number
    says nothing of how many drafted tokens this drafter gets accepted."""

    speculative: SpeculativeConfig
    source: str  # where the figures come from, shown after the flags

    def proposal(self) -> str:
        spec = self.speculative
        return f"{chain_flags(spec.num_steps, spec.eagle_topk, spec.num_draft_tokens)} ({self.source})"


@dataclass
class Context:
    parsed: ParsedArgv
    table: FlagTable
    version: str
    behaviour: VersionBehaviour
    check_checkpoints: bool = True
    measured: Optional[MeasuredChain] = None

    # Effective speculative settings as SGLang reads them from argv.
    def int_value(self, dest: str) -> Optional[int]:
        raw = self.parsed.value(dest)
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return None  # reported by the flag-value rule

    @property
    def algorithm(self) -> Optional[str]:
        raw = self.parsed.value("speculative_algorithm")
        # Upper-cased even where argparse would reject the case (that is reported by the algorithm-name rule),
        # so the other rules still check what the user meant.
        return raw.upper() if raw is not None else None

    @property
    def is_eagle_family(self) -> bool:
        return self.algorithm in EAGLE_FAMILY

    @property
    def adaptive(self) -> bool:
        return self.parsed.flag_set("speculative_adaptive")

    @property
    def adaptive_stays_on(self) -> bool:
        """SGLang turns --speculative-adaptive off (with a warning) unless EAGLE/EAGLE3, topk 1 or unset, no DP attention
        (speculative/adaptive_spec_params.py adaptive_unsupported_reason); the triple checks then apply as without it."""
        topk = self.int_value("speculative_eagle_topk")
        return (
            self.adaptive
            and self.algorithm in ("EAGLE", "EAGLE3")
            and topk in (None, 1)
            and not self.parsed.flag_set("enable_dp_attention")
        )

    def opt(self, dest: str) -> str:
        return self.parsed.option_name(dest)

    def checkpoint(self, dest: str) -> Optional[CheckpointInfo]:
        raw = self.parsed.value(dest)
        return read_checkpoint(raw) if raw is not None and self.check_checkpoints else None


Check = Callable[[Context], Iterator[Finding]]


@dataclass(frozen=True)
class Rule:
    id: str
    summary: str
    check: Check
    phase: str = "server-args"  # where SGLang fails for this rule's errors, unless a finding says otherwise


def _err(rule: str, flags, message: str, fix: str, phase: Optional[str] = None) -> Finding:
    return Finding("error", rule, tuple(flags), message, fix, phase)


def _warn(rule: str, flags, message: str, fix: str) -> Finding:
    return Finding("warning", rule, tuple(flags), message, fix)


# --- argv-level rules --------------------------------------------------------------------------------


def _num_speculative_tokens_fix(item: ArgvItem, measured: Optional[MeasuredChain]) -> str:
    if measured is not None:
        return measured.proposal()
    try:
        n = int(item.values[0]) if item.values else None
    except ValueError:
        n = None
    return chain_flags("N", 1, "N+1") if n is None else chain_flags(n, 1, n + 1)


def _speculative_config_fix(item: ArgvItem, measured: Optional[MeasuredChain]) -> tuple[str, str]:
    """(what the JSON meant, the fix) for vLLM's --speculative-config."""
    chain = measured.proposal() if measured else chain_flags("N", 1, "N+1")
    generic = f"write SGLang flags instead: --speculative-algorithm EAGLE3 --speculative-draft-model-path DIR {chain}"
    try:
        config = json.loads(item.values[0]) if item.values else None
    except json.JSONDecodeError as err:
        return f"its value is not valid JSON either: {err}", generic
    if not isinstance(config, dict):
        return "its value is not a JSON object", generic
    flags: list[str] = []
    method = str(config.get("method", "")).lower()
    if method:
        if method in VLLM_METHODS:
            flags += ["--speculative-algorithm", VLLM_METHODS[method]]
        else:
            return f"method {method!r} has no SGLang equivalent", f"pick one of SGLang's algorithms ({', '.join(sorted(set(VLLM_METHODS.values())))})"
    if config.get("model"):
        flags += ["--speculative-draft-model-path", str(config["model"])]
    n = config.get("num_speculative_tokens")
    if measured is not None:
        flags.append(measured.proposal())
    elif isinstance(n, int):
        flags.append(chain_flags(n, 1, n + 1))
    ignored = sorted(set(config) - {"method", "model", "num_speculative_tokens"})
    note = f"; keys with no direct SGLang flag: {', '.join(ignored)}" if ignored else ""
    return f"it holds {json.dumps(config)}{note}", ("replace it with " + " ".join(flags)) if flags else generic


def check_unknown_flags(ctx: Context) -> Iterator[Finding]:
    known = list(ctx.table.flags)
    for item in ctx.parsed.items:
        if item.abbreviates is not None:
            yield _warn(
                "abbreviated-flag", [item.option],
                f"{item.option} is not an SGLang option, but argparse accepts it as an abbreviation of {item.abbreviates} "
                "(a later SGLang option with the same prefix would turn it into an error).",
                f"spell it out: {item.abbreviates}",
            )  # fmt: skip
            continue
        if item.spec is not None:
            continue
        option = item.option
        where = f"SGLang {ctx.table.version}"
        if option == "--num-speculative-tokens":
            yield _err(
                "vllm-flag", [option],
                f"{item.as_written()} is vLLM's option; {where} has no such flag and argparse stops with "
                "'unrecognized arguments'. vLLM's N proposed tokens in a chain are SGLang's --speculative-num-steps "
                "with --speculative-eagle-topk 1 (and a verify width of N+1 tokens).",
                f"replace it with {_num_speculative_tokens_fix(item, ctx.measured)}",
            )  # fmt: skip
            continue
        if option == "--speculative-config":
            meaning, fix = _speculative_config_fix(item, ctx.measured)
            yield _err(
                "vllm-flag", [option],
                f"--speculative-config is vLLM's JSON option; {where} takes separate --speculative-* flags ({meaning}).",
                fix,
            )  # fmt: skip
            continue
        if option in VLLM_EQUIVALENTS:
            target = VLLM_EQUIVALENTS[option]
            if target is not None and target in ctx.table.flags:
                values = " ".join(item.values)
                yield _err(
                    "vllm-flag", [option],
                    f"{option} is vLLM's name; {where} does not know it.",
                    f"use {target}{' ' + values if values else ''} (check the unit: e.g. --mem-fraction-static is a "
                    "fraction like vLLM's --gpu-memory-utilization, --chunked-prefill-size is per-chunk tokens)"
                    if option in ("--gpu-memory-utilization", "--max-num-batched-tokens")
                    else f"use {target}{' ' + values if values else ''}",
                )  # fmt: skip
            else:
                yield _err(
                    "vllm-flag", [option],
                    f"{option} is a vLLM option with no SGLang {ctx.table.version} equivalent.",
                    "remove it",
                )  # fmt: skip
            continue
        prefixed = ctx.table.abbreviation_of(option)
        close = difflib.get_close_matches(option, known, n=3, cutoff=0.6)
        if len(prefixed) > 1:
            message = f"{option} is an ambiguous abbreviation of {', '.join(prefixed[:5])}; argparse stops with an error."
        else:
            message = f"{option} is not an option of SGLang {ctx.table.version} (argparse: 'unrecognized arguments')."
        suggestion = close or prefixed[:3]
        fix = f"did you mean {' or '.join(suggestion)}?" if suggestion else "remove it (see `python -m sglang.launch_server --help`)"
        yield _err("unknown-flag", [option], message, fix)


def check_positionals(ctx: Context) -> Iterator[Finding]:
    for _, token in ctx.parsed.positionals:
        yield _err(
            "stray-value", [token],
            f"{token!r} is not attached to any option (a value after a flag that takes none, or a typo); "
            "SGLang's parser stops with 'unrecognized arguments'.",
            "remove it or put the option it belongs to in front of it",
        )  # fmt: skip


def check_flag_values(ctx: Context) -> Iterator[Finding]:
    for item in ctx.parsed.items:
        spec = item.spec
        if spec is None:
            continue
        if item.missing_value:
            yield _err("flag-value", [item.option], f"{item.option} needs a value and none follows it.", f"write {item.option} VALUE")
            continue
        if spec.nargs == 0 and item.inline_value:
            yield _err("flag-value", [item.option], f"{item.option} is a switch and takes no value (got {item.as_written()}).", f"write {item.option} alone")
            continue
        for value in item.values:
            if spec.type in ("int", "float"):
                try:
                    int(value) if spec.type == "int" else float(value)
                except ValueError:
                    yield _err("flag-value", [item.option], f"{item.option} takes an {spec.type}, got {value!r}.", f"give {item.option} a number")
                    continue
            # The algorithm has its own rule with version-specific case handling.
            if spec.choices is not None and spec.dest != "speculative_algorithm" and value not in [str(c) for c in spec.choices]:
                close = difflib.get_close_matches(value, [str(c) for c in spec.choices], n=3, cutoff=0.5)
                hint = f"did you mean {' or '.join(close)}? " if close else ""
                yield _err(
                    "flag-value", [item.option],
                    f"{value!r} is not a valid choice for {item.option} in SGLang {ctx.table.version}.",
                    f"{hint}choices: {', '.join(map(str, spec.choices))}",
                )  # fmt: skip


def check_duplicates(ctx: Context) -> Iterator[Finding]:
    seen: dict[str, list[ArgvItem]] = {}
    for item in ctx.parsed.items:
        if item.dest is not None:
            seen.setdefault(item.dest, []).append(item)
    for dest, items in seen.items():
        if len(items) > 1 and items[0].spec.nargs != 0:
            written = ", ".join(i.as_written() for i in items)
            yield _warn(
                "duplicate-flag", [i.option for i in items],
                f"{dest} is given {len(items)} times ({written}); argparse keeps only the last one.",
                f"keep one: {items[-1].as_written()}",
            )  # fmt: skip


def check_deprecated(ctx: Context) -> Iterator[Finding]:
    for item in ctx.parsed.items:
        if item.spec is not None and item.spec.deprecated:
            replacement = item.spec.replacement
            yield _warn(
                "deprecated-flag", [item.option],
                f"{item.option} is deprecated in SGLang {ctx.table.version}.",
                f"use {replacement} instead" if replacement else f"see `--help` for what replaces {item.option}",
            )  # fmt: skip


def check_required(ctx: Context) -> Iterator[Finding]:
    required = {spec.dest: spec.canonical for spec in ctx.table.flags.values() if spec.required}
    for dest, option in sorted(required.items()):
        if not ctx.parsed.given(dest):
            yield _err("required-flag", [option], f"{option} is required by SGLang {ctx.table.version}.", f"add {option} PATH")


# --- speculative rules ----------------------------------------------------------------------------------


def check_algorithm(ctx: Context) -> Iterator[Finding]:
    raw = ctx.parsed.value("speculative_algorithm")
    if raw is None:
        return
    b = ctx.behaviour
    option = ctx.opt("speculative_algorithm")
    if b.algorithm_choices is not None:
        if raw in b.algorithm_choices:
            return
        if raw.upper() in b.algorithm_choices:
            yield _err(
                "algorithm-name", [option],
                f"SGLang {ctx.version} checks {option} against case-sensitive choices; {raw!r} is rejected at parse time.",
                f"write {option} {raw.upper()}",
                phase="parse",
            )  # fmt: skip
            return
        names = b.algorithm_choices
    else:
        if raw.upper() in b.builtin_algorithms:
            return
        names = b.builtin_algorithms
    guess = VLLM_METHODS.get(raw.lower()) or next(iter(difflib.get_close_matches(raw.upper(), names, n=1, cutoff=0.5)), None)
    yield _err(
        "algorithm-name", [option],
        f"{raw!r} is not a speculative algorithm of SGLang {ctx.version} (built in: {', '.join(names)}); "
        "SGLang raises 'Unknown speculative algorithm name' (0.5.12+: only after reading the model config; "
        "names registered by a plugin cannot be checked here).",
        f"use {option} {guess}" if guess else f"use one of {', '.join(names)}",
        phase="parse" if b.algorithm_choices is not None else "server-args",
    )  # fmt: skip


SPEC_TUNING_DESTS = (
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_draft_model_path",
    "speculative_token_map",
)


def check_spec_without_algorithm(ctx: Context) -> Iterator[Finding]:
    if ctx.parsed.value("speculative_algorithm") is not None:
        return
    given = [ctx.opt(d) for d in SPEC_TUNING_DESTS if ctx.parsed.given(d)]
    if given:
        yield _warn(
            "speculative-without-algorithm", given,
            f"{', '.join(given)} given without --speculative-algorithm: SGLang runs without speculative decoding and "
            "ignores them.",
            "add --speculative-algorithm EAGLE3 (or the algorithm your draft was trained for)",
        )  # fmt: skip


def check_partial_triple(ctx: Context) -> Iterator[Finding]:
    if not ctx.is_eagle_family or ctx.parsed.given("speculative_num_steps"):
        return
    if ctx.adaptive_stays_on and ctx.behaviour.adaptive_skips_triple_assert:
        return
    given = [d for d in ("speculative_eagle_topk", "speculative_num_draft_tokens") if ctx.parsed.given(d)]
    if not given:
        return
    topk = ctx.int_value("speculative_eagle_topk")
    ndt = ctx.int_value("speculative_num_draft_tokens")
    if ctx.measured is not None:
        fix = (f"write {ctx.measured.proposal()} in place of {', '.join(ctx.opt(d) for d in given)}, or remove "
               f"{', '.join(ctx.opt(d) for d in given)} to let SGLang choose all three")
    elif ndt is not None and topk in (None, 1):
        steps = max(ndt - 1, 1)
        fix = (
            f"add {chain_flags(steps, 1, steps + 1)} "
            f"(a chain of {steps} draft tokens), or remove {', '.join(ctx.opt(d) for d in given)} to let SGLang choose all three"
        )
    else:
        fix = (
            "add --speculative-num-steps S (and --speculative-num-draft-tokens), or remove "
            f"{', '.join(ctx.opt(d) for d in given)} to let SGLang choose all three"
        )
    adaptive_note = (
        " (--speculative-adaptive does not avoid this: SGLang turns it off for this command, or the release predates 0.5.20)"
        if ctx.adaptive
        else ""
    )
    yield _err(
        "partial-speculative-triple", [ctx.opt(d) for d in given] + ["--speculative-num-steps"],
        f"{', '.join(ctx.opt(d) for d in given)} given without --speculative-num-steps: SGLang {ctx.version} "
        "asserts that when --speculative-num-steps is unset, --speculative-eagle-topk and "
        "--speculative-num-draft-tokens are unset too, and dies with a bare AssertionError in "
        f"{ctx.behaviour.source} after loading the model config{adaptive_note}.",
        fix,
    )  # fmt: skip


def check_steps_without_topk(ctx: Context) -> Iterator[Finding]:
    if not ctx.is_eagle_family or not ctx.parsed.given("speculative_num_steps"):
        return
    if ctx.parsed.given("speculative_eagle_topk"):
        return
    if ctx.adaptive_stays_on and ctx.behaviour.adaptive_skips_triple_assert:
        return
    steps = ctx.int_value("speculative_num_steps")
    shown = steps if steps is not None else "S"
    nxt = steps + 1 if steps is not None else "S+1"
    yield _err(
        "steps-without-topk", ["--speculative-num-steps", "--speculative-eagle-topk"],
        f"--speculative-num-steps is set but --speculative-eagle-topk is not: SGLang {ctx.version} does not fill topk in "
        "and fails with \"TypeError: '>' not supported between instances of 'NoneType' and 'int'\" while checking "
        "topk > 1.",
        f"write {ctx.measured.proposal()}" if ctx.measured else
        f"add --speculative-eagle-topk 1 --speculative-num-draft-tokens {nxt} (a chain of {shown})",
    )  # fmt: skip


def check_tree_draft_tokens(ctx: Context) -> Iterator[Finding]:
    if not ctx.is_eagle_family:
        return
    steps, topk, ndt = (ctx.int_value(d) for d in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"))
    if steps is None or topk is None:
        return
    if topk == 1:
        if ndt is not None and ndt != steps + 1:
            yield _warn(
                "topk1-draft-tokens", ["--speculative-num-draft-tokens", "--speculative-num-steps"],
                f"with --speculative-eagle-topk 1, SGLang {ctx.version} silently changes --speculative-num-draft-tokens "
                f"{ndt} to num_steps + 1 = {steps + 1} (a chain verifies every drafted token plus one).",
                f"write --speculative-num-draft-tokens {steps + 1}, or raise --speculative-num-steps to {ndt - 1} "
                f"if you meant {ndt} verified tokens",
            )  # fmt: skip
        return
    if ndt is None:
        yield _err(
            "tree-without-draft-tokens", ["--speculative-num-draft-tokens", "--speculative-eagle-topk"],
            f"--speculative-eagle-topk {topk} (a tree) without --speculative-num-draft-tokens: SGLang derives it only "
            "for topk 1 and fails later with it unset.",
            f"add --speculative-num-draft-tokens N with 2 <= N <= {1 + topk + (steps - 1) * topk * topk}",
            phase="load",
        )  # fmt: skip
        return
    capacity = 1 + topk + (steps - 1) * topk * topk
    if ndt > capacity:
        yield _err(
            "draft-tokens-exceed-tree", ["--speculative-num-draft-tokens", "--speculative-num-steps", "--speculative-eagle-topk"],
            f"--speculative-num-draft-tokens {ndt} is more than a tree of {steps} steps x topk {topk} can hold: "
            f"1 + topk + (steps-1)*topk^2 = {capacity} (root, topk first-step candidates, topk^2 per later step).",
            f"use --speculative-num-draft-tokens <= {capacity}, or more steps / a larger topk",
            phase="first-draft-step",
        )  # fmt: skip


def _backends(ctx: Context) -> dict[str, str]:
    return {
        ctx.opt(d): v
        for d in ("attention_backend", "decode_attention_backend", "prefill_attention_backend")
        if (v := ctx.parsed.value(d)) is not None
    }


def check_trtllm_topk(ctx: Context) -> Iterator[Finding]:
    topk = ctx.int_value("speculative_eagle_topk")
    if not ctx.is_eagle_family or topk is None or topk <= 1:
        return
    offending = [opt for opt, v in _backends(ctx).items() if v == "trtllm_mha"]
    if offending:
        yield _err(
            "trtllm-mha-topk", offending + ["--speculative-eagle-topk"],
            f"trtllm_mha supports only --speculative-eagle-topk 1; SGLang {ctx.version} raises ValueError for topk {topk}.",
            "use --speculative-eagle-topk 1, or another attention backend (e.g. flashinfer, fa3)",
        )  # fmt: skip


def check_page_size_tree(ctx: Context) -> Iterator[Finding]:
    topk = ctx.int_value("speculative_eagle_topk")
    page = ctx.int_value("page_size")
    if not ctx.is_eagle_family or topk is None or topk <= 1 or page is None or page <= 1:
        return
    allowed = ctx.behaviour.page_tree_backends
    backend = ctx.parsed.value("attention_backend")
    if backend is None:
        yield _warn(
            "page-size-tree-backend", ["--page-size", "--speculative-eagle-topk", "--attention-backend"],
            f"--speculative-eagle-topk {topk} with --page-size {page} works in SGLang {ctx.version} only with attention "
            f"backend {', '.join(allowed)}; none is given, so SGLang's automatic choice decides whether it starts.",
            f"add --attention-backend {allowed[0]}",
        )  # fmt: skip
    elif backend not in allowed:
        yield _err(
            "page-size-tree-backend", ["--page-size", "--speculative-eagle-topk", "--attention-backend"],
            f"--speculative-eagle-topk {topk} with --page-size {page} needs attention backend {' or '.join(allowed)} in "
            f"SGLang {ctx.version}; {backend!r} raises ValueError (paged tree drafting gives wrong results there).",
            f"use --attention-backend {allowed[0]}, --page-size 1, or --speculative-eagle-topk 1",
        )  # fmt: skip


def check_draft_path(ctx: Context) -> Iterator[Finding]:
    draft = ctx.parsed.value("speculative_draft_model_path")
    if draft is not None:
        info = ctx.checkpoint("speculative_draft_model_path")
        if ctx.algorithm is not None and info is not None and info.written_as.startswith(("/", ".", "~")) and not info.path.exists():
            b = ctx.behaviour
            yield _err(
                "draft-path-missing", [ctx.opt("speculative_draft_model_path")],
                f"{draft} does not exist. SGLang {ctx.version} "
                + ("reads the draft's config inside ServerArgs and raises OSError (it takes the path for a hub repo id)."
                   if b.reads_draft_config else "fails when the draft worker loads it."),
                "point --speculative-draft-model-path at the exported draft directory (`draftline export` output)",
                phase="server-args" if b.reads_draft_config else "load",
            )  # fmt: skip
        return
    if ctx.algorithm == "EAGLE3":
        yield _err(
            "eagle3-without-draft", ["--speculative-algorithm", "--speculative-draft-model-path"],
            "EAGLE3 without --speculative-draft-model-path: SGLang's draft worker falls back to --model-path and loads "
            "the target itself as the drafter (wrong architecture, a second copy of the weights).",
            "add --speculative-draft-model-path DRAFT_DIR (the exported EAGLE-3 checkpoint)",
        )  # fmt: skip
    elif ctx.algorithm == "STANDALONE":
        yield _err(
            "standalone-without-draft", ["--speculative-algorithm", "--speculative-draft-model-path"],
            "STANDALONE speculative decoding needs a separate small draft model; without "
            "--speculative-draft-model-path SGLang drafts with the target itself.",
            "add --speculative-draft-model-path DRAFT_DIR",
        )  # fmt: skip


def _backend_values(ctx: Context) -> set[str]:
    return set(_backends(ctx).values())


def check_speculative_combinations(ctx: Context) -> Iterator[Finding]:
    """Combinations SGLang's ServerArgs refuses with speculative decoding (attention, parallelism, paging)."""
    algo = ctx.algorithm
    if algo is None:
        return
    option = ctx.opt("speculative_algorithm")
    if "flex_attention" in _backend_values(ctx):
        yield _err(
            "flex-attention-speculative", [ctx.opt("attention_backend"), option],
            f"SGLang {ctx.version} asserts that speculative decoding is not used with the flex_attention backend.",
            "use another --attention-backend (e.g. triton or flashinfer), or drop speculative decoding",
        )  # fmt: skip
    pp_dest = "pp_size" if ctx.parsed.given("pp_size") else "pipeline_parallel_size"  # renamed in 0.5.20
    pp = ctx.int_value(pp_dest)
    allowed = ctx.behaviour.pp_speculative_algorithms
    if pp is not None and pp > 1 and algo not in allowed:
        yield _err(
            "pp-speculative", [ctx.opt(pp_dest), option],
            f"--pp-size {pp} with {algo}: SGLang {ctx.version}'s check_server_args asserts that pipeline parallelism "
            + ("runs only EAGLE (non-multi-layer) speculative decoding." if allowed else "runs without speculative decoding."),
            "use --pp-size 1 (tensor parallelism: --tp-size)"
            + (", or --speculative-algorithm EAGLE with an EAGLE draft" if allowed else ", or drop speculative decoding"),
        )  # fmt: skip
    if algo in ("STANDALONE", "NGRAM") and ctx.parsed.flag_set("enable_dp_attention"):
        yield _err(
            "dp-attention-speculative", [ctx.opt("enable_dp_attention"), option],
            f"SGLang {ctx.version} raises ValueError: {algo} speculative decoding does not support DP attention.",
            "drop --enable-dp-attention, or use EAGLE/EAGLE3",
        )  # fmt: skip
    page = ctx.int_value("page_size")
    if algo == "NGRAM" and page is not None and page > 1:
        yield _err(
            "ngram-page-size", [ctx.opt("page_size"), option],
            f"NGRAM drafts a tree (topk {ctx.int_value('speculative_eagle_topk') or 10} by default) and SGLang "
            f"{ctx.version} raises ValueError for a tree with --page-size {page} > 1 on paged attention backends.",
            "use --page-size 1 with NGRAM",
        )  # fmt: skip


def check_adaptive_steps(ctx: Context) -> Iterator[Finding]:
    """With the default --speculative-adaptive-config (speculative/adaptive_spec_params.py), the starting step count
    must be one of its candidate_steps."""
    candidates = ctx.behaviour.adaptive_candidate_steps
    if candidates is None or not ctx.adaptive_stays_on or ctx.parsed.given("speculative_adaptive_config"):
        return
    steps = ctx.int_value("speculative_num_steps")
    if steps is not None and steps not in candidates:
        allowed = ", ".join(map(str, candidates))
        yield _err(
            "adaptive-steps", [ctx.opt("speculative_num_steps"), ctx.opt("speculative_adaptive")],
            f"with --speculative-adaptive, SGLang {ctx.version} starts from --speculative-num-steps and raises "
            f"ValueError when it is not one of the adaptive config's candidate steps ({allowed}); {steps} is not.",
            f"use --speculative-num-steps one of {allowed}, or pass --speculative-adaptive-config with {steps} in candidate_steps",
        )  # fmt: skip


def check_rejection_sampling(ctx: Context) -> Iterator[Finding]:
    if not ctx.parsed.flag_set("speculative_use_rejection_sampling"):
        return
    option = ctx.opt("speculative_use_rejection_sampling")
    algo = ctx.algorithm
    if algo is not None and algo not in ("EAGLE", "EAGLE3", "NEXTN"):
        yield _err(
            "rejection-sampling", [option, ctx.opt("speculative_algorithm")],
            f"SGLang {ctx.version} supports {option} only for EAGLE / EAGLE3 / NEXTN (NotImplementedError for {algo}).",
            f"drop {option}, or use EAGLE3",
        )  # fmt: skip
        return
    topk = ctx.int_value("speculative_eagle_topk")
    if topk is not None and topk != 1:
        yield _err(
            "rejection-sampling", [option, ctx.opt("speculative_eagle_topk")],
            f"{option} verifies a chain: SGLang {ctx.version} requires --speculative-eagle-topk 1 (got {topk}).",
            f"use --speculative-eagle-topk 1 with {option}, or drop it for tree drafting",
        )  # fmt: skip
    thresholds = [ctx.opt(d) for d in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc") if ctx.parsed.given(d)]
    if thresholds:
        yield _err(
            "rejection-sampling", [option, *thresholds],
            f"{option} is incompatible with {' / '.join(thresholds)} in SGLang {ctx.version} (rejection sampling "
            "decides acceptance itself).",
            f"drop {' and '.join(thresholds)}",
        )  # fmt: skip


def check_draft_window(ctx: Context) -> Iterator[Finding]:
    window = ctx.int_value("speculative_draft_window_size")
    sink = ctx.int_value("speculative_draft_sink_size")
    if window is not None and window <= 0 and ctx.behaviour.checks_draft_window:
        yield _err(
            "draft-window", [ctx.opt("speculative_draft_window_size")],
            f"SGLang {ctx.version} requires a positive --speculative-draft-window-size (got {window}).",
            "use a positive window (tokens of draft attention), or drop the option",
        )  # fmt: skip
    if sink is None:
        return
    if sink < 0:
        yield _err(
            "draft-window", [ctx.opt("speculative_draft_sink_size")],
            f"SGLang {ctx.version} requires a non-negative --speculative-draft-sink-size (got {sink}).",
            "use --speculative-draft-sink-size 0 or more",
        )  # fmt: skip
    if window is None:
        yield _err(
            "draft-window", [ctx.opt("speculative_draft_sink_size"), ctx.opt("speculative_draft_window_size")],
            f"--speculative-draft-sink-size requires --speculative-draft-window-size in SGLang {ctx.version}.",
            "add --speculative-draft-window-size N, or drop --speculative-draft-sink-size",
        )  # fmt: skip


def check_dflash_block(ctx: Context) -> Iterator[Finding]:
    block = ctx.int_value("speculative_dflash_block_size")
    if ctx.algorithm != "DFLASH" or block is None:
        return
    option = ctx.opt("speculative_dflash_block_size")
    if block <= 0:
        yield _err("dflash-block-size", [option], f"SGLang {ctx.version} requires a positive {option} (got {block}).", f"use a positive {option} (the verify window)")
        return
    ndt = ctx.int_value("speculative_num_draft_tokens")
    if ndt is not None and ndt != block:
        yield _err(
            "dflash-block-size", [option, ctx.opt("speculative_num_draft_tokens")],
            f"for DFLASH, {option} {block} and --speculative-num-draft-tokens {ndt} must match; SGLang {ctx.version} raises ValueError.",
            f"drop --speculative-num-draft-tokens (DFLASH takes it from {option}), or make them equal",
        )  # fmt: skip


def check_auto_params(ctx: Context) -> Iterator[Finding]:
    """No triple at all: SGLang picks one by target architecture, and the pick changed between versions."""
    if not ctx.is_eagle_family or ctx.adaptive:
        return
    if any(item.option in ("--num-speculative-tokens", "--speculative-config") for item in ctx.parsed.items):
        return  # the vllm-flag finding already gives the explicit triple
    if any(ctx.parsed.given(d) for d in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")):
        return
    target = ctx.checkpoint("model_path")
    arch = target.architecture if target else None
    b = ctx.behaviour
    if arch == "LlamaForCausalLM":
        chosen = f"{b.auto_params_llama} for {arch}"
    elif arch:
        chosen = f"{b.auto_params_other} for {arch}"
    else:
        chosen = f"{b.auto_params_llama} for LlamaForCausalLM, {b.auto_params_other} for most other architectures"
    yield _warn(
        "auto-speculative-params", ["--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"],
        f"no (num_steps, eagle_topk, num_draft_tokens) given: SGLang {ctx.version} chooses {chosen}; the choice for "
        "non-Llama targets changed from (5, 4, 8) to (3, 1, 4) in 0.5.23, so benchmarks are not comparable across versions.",
        f"pass all three explicitly, e.g. {chain_flags(3, 1, 4)}",
    )  # fmt: skip


# --- checkpoint rules (read config.json and safetensors headers; never tensors) --------------------------


def check_checkpoints(ctx: Context) -> Iterator[Finding]:
    if ctx.algorithm != "EAGLE3" or not ctx.check_checkpoints:
        return
    draft_raw = ctx.parsed.value("speculative_draft_model_path")
    target_raw = ctx.parsed.value("model_path")
    if draft_raw is None:
        return
    draft = read_checkpoint(draft_raw)
    target = read_checkpoint(target_raw) if target_raw is not None else None
    draft_flag, target_flag = ctx.opt("speculative_draft_model_path"), ctx.opt("model_path")
    for info, flag in ((draft, draft_flag), (target, target_flag)):
        if info is not None and info.problem and (info.is_local or info.config is not None):
            yield _warn("checkpoint-unreadable", [flag], f"{flag} {info.path}: {info.problem}; checkpoint checks skipped for it.", f"point {flag} at a local HF model directory with config.json")
    if draft is None or draft.config is None:
        return
    b = ctx.behaviour
    if draft.architecture not in b.eagle3_draft_architectures:
        yield _err(
            "draft-architecture", [draft_flag],
            f"{draft.path}/config.json declares architectures {draft.architectures}; SGLang {ctx.version} loads an EAGLE3 "
            f"draft only as {' or '.join(b.eagle3_draft_architectures)} (it does not rename Llama drafts).",
            f'set "architectures": ["{b.eagle3_draft_architectures[0]}"] in the draft config.json (re-export the drafter)',
        )  # fmt: skip
    draft_vocab = draft.config.get("draft_vocab_size")
    if draft.d2t_length is not None and draft_vocab is not None and draft.d2t_length != draft_vocab:
        yield _err(
            "draft-vocab-d2t", [draft_flag],
            f"draft config draft_vocab_size={draft_vocab} but the d2t tensor in {draft.d2t_file} has {draft.d2t_length} "
            "entries; SGLang maps draft ids with hot_token_id = d2t + arange(len(d2t)), which must cover the draft vocab.",
            "re-export the drafter so draft_vocab_size equals len(d2t)",
        )  # fmt: skip
    vocab = draft.config.get("vocab_size")
    if draft.d2t_length is None and draft_vocab is not None and vocab is not None and draft_vocab < vocab and not ctx.parsed.given("speculative_token_map"):
        yield _err(
            "draft-vocab-d2t", [draft_flag],
            f"draft_vocab_size={draft_vocab} < vocab_size={vocab} but no d2t tensor is in the draft safetensors and no "
            "--speculative-token-map is given: draft ids would be read as target ids.",
            "export d2t with the drafter (or pass --speculative-token-map)",
        )  # fmt: skip
    if target is None or target.config is None:
        return
    target_hidden = target.config.get("hidden_size")
    draft_target_hidden = draft.config.get("target_hidden_size", draft.config.get("hidden_size"))
    if target_hidden is not None and draft_target_hidden is not None and draft_target_hidden != target_hidden:
        key = "target_hidden_size" if "target_hidden_size" in draft.config else "hidden_size (no target_hidden_size)"
        yield _err(
            "draft-target-hidden-size", [draft_flag, target_flag],
            f"draft {key}={draft_target_hidden} but the target's hidden_size is {target_hidden}: the draft's fc layer "
            "cannot take the target's hidden states.",
            "train/export the drafter for this target (target_hidden_size must equal the target's hidden_size)",
        )  # fmt: skip
    target_vocab = target.config.get("vocab_size")
    if vocab is not None and target_vocab is not None and vocab != target_vocab:
        yield _warn(
            "draft-target-vocab", [draft_flag, target_flag],
            f"draft vocab_size={vocab} differs from the target's {target_vocab}; SGLang gives the draft the target's "
            "embedding, so d2t offsets computed for another tokenizer point at wrong tokens.",
            "export the drafter from a dataset prepared with this target's tokenizer",
        )  # fmt: skip
    if target.architecture in TARGET_CAPTURE:
        yield from _target_capture(ctx, target.architecture, [draft_flag, target_flag])
    aux_ids = (draft.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    num_layers = target.config.get("num_hidden_layers")
    if aux_ids is not None and num_layers is not None:
        try:
            capture_ids_from_written(family_of(target.config), "sglang", ctx.version, num_layers, aux_ids,
                                     where=f"{draft.path}/config.json eagle_config.eagle_aux_hidden_state_layer_ids")
        except AuxLayerIdError as err:
            yield _err(
                "aux-layer-ids", [draft_flag, target_flag],
                f"{err}: SGLang would capture other hidden states than the drafter was trained on.",
                "re-export the drafter for this target (draftline's default ids: [1, n//2-1, n-4])",
            )  # fmt: skip
        fixed = b.fixed_aux_layer_count
        if fixed is not None and len(aux_ids) != fixed:
            yield _err(
                "aux-layer-count", [draft_flag],
                f"SGLang {ctx.version}'s LlamaForCausalLMEagle3 always builds fc for {fixed} aux hidden states, but the "
                f"draft lists {len(aux_ids)} ids ({aux_ids}); weights will not load (0.5.12+ reads the count from eagle_config).",
                f"train with {fixed} aux layers, or run SGLang 0.5.12 or newer",
            )  # fmt: skip


# What SGLang's model code captures as EAGLE-3 aux states, for target architectures where it is not the residual
# stream (HF's hidden_states[k], what draftline trains on) in every release: (first version, before version, what).
# Gemma 3, read in gemma3_causal.py of every released wheel from 0.5.6 to 0.5.23: no EAGLE-3 before 0.5.12 (no
# set_eagle3_layers_to_capture); 0.5.12-0.5.16 the layers add their residual themselves, so the stream is captured;
# from 0.5.17 they keep the residual apart for a fused add-norm and the capture appends `hidden_states` alone, the
# layer's normalised MLP output.
TARGET_CAPTURE: dict[str, tuple[tuple[str, Optional[str], str], ...]] = {
    "Gemma3ForCausalLM": (("0.0", "0.5.12", "none"), ("0.5.12", "0.5.17", "stream"), ("0.5.17", None, "mlp-output")),
}


def target_capture(architecture: str, version: str) -> str:
    """What SGLang `version` captures as EAGLE-3 aux states for `architecture` (a TARGET_CAPTURE key)."""
    return next(what for first, before, what in TARGET_CAPTURE[architecture] if version_in(version, first, before))


def _target_capture(ctx: Context, architecture: str, flags: list[str]) -> Iterator[Finding]:
    ranges = TARGET_CAPTURE[architecture]
    captured = target_capture(architecture, ctx.version)
    good = " or ".join(f"{first}-{before}" if before else f"{first}+" for first, before, what in ranges if what == "stream")
    fix = f"serve this target with SGLang {good} (or draftline's reference engine)"
    if captured == "none":
        yield _err("target-capture", flags, f"SGLang {ctx.version}'s {architecture} has no EAGLE-3 aux-state capture "
                   "(no set_eagle3_layers_to_capture): the EAGLE-3 worker fails when it asks for it.", fix)  # fmt: skip
    elif captured == "mlp-output":
        yield _warn("target-capture", flags, f"SGLang {ctx.version}'s {architecture} keeps the residual apart and "
                    "captures each layer's normalised MLP output, not the residual stream the drafter was trained on: "
                    "serving stays lossless but the drafter sees other features and acceptance falls to about nothing.",
                    fix)  # fmt: skip


RULES: tuple[Rule, ...] = (
    Rule("unknown-flag", "unknown options (did-you-mean), vLLM names mapped to SGLang's, abbreviations", check_unknown_flags, "parse"),
    Rule("stray-value", "tokens not attached to any option", check_positionals, "parse"),
    Rule("flag-value", "missing values, non-numbers, invalid choices", check_flag_values, "parse"),
    Rule("duplicate-flag", "an option given twice (last wins)", check_duplicates),
    Rule("deprecated-flag", "deprecated options", check_deprecated),
    Rule("required-flag", "required options missing", check_required, "parse"),
    Rule("algorithm-name", "speculative algorithm spelled as the version accepts", check_algorithm),
    Rule("speculative-without-algorithm", "speculative tuning without an algorithm", check_spec_without_algorithm),
    Rule("partial-speculative-triple", "topk / draft tokens without num_steps (bare AssertionError)", check_partial_triple),
    Rule("steps-without-topk", "num_steps without topk (TypeError)", check_steps_without_topk),
    Rule("tree-draft-tokens", "topk 1 rewrite, tree capacity, missing draft tokens", check_tree_draft_tokens),
    Rule("trtllm-mha-topk", "trtllm_mha only with topk 1", check_trtllm_topk),
    Rule("page-size-tree-backend", "topk > 1 with page_size > 1 needs certain backends", check_page_size_tree),
    Rule("eagle3-without-draft", "EAGLE3 / STANDALONE without a draft path", check_draft_path, "load"),
    Rule("speculative-combinations", "flex_attention, pipeline parallelism, DP attention, NGRAM paging", check_speculative_combinations),
    Rule("adaptive-steps", "--speculative-adaptive starts from one of its candidate step counts", check_adaptive_steps),
    Rule("rejection-sampling", "rejection sampling: EAGLE family, topk 1, no thresholds", check_rejection_sampling),
    Rule("draft-window", "draft attention window and sink sizes", check_draft_window),
    Rule("dflash-block-size", "DFLASH block size positive and equal to the verify width", check_dflash_block),
    Rule("auto-speculative-params", "triple chosen by SGLang (differs by version)", check_auto_params),
    Rule("checkpoints", "draft vs target config.json / d2t / aux layer ids", check_checkpoints, "load"),
)


def run_rules(ctx: Context) -> list[Finding]:
    return [
        replace(finding, phase=finding.phase or rule.phase) if finding.level == "error" else finding
        for rule in RULES
        for finding in rule.check(ctx)
    ]

