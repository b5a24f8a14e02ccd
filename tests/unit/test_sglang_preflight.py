"""SGLang launch preflight: one test per rule, the reported incident, valid commands, version differences."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from draftline.config import SpeculativeConfig, load_config
from draftline.engines.sglang.args import flag_table_for, read_argv
from draftline.engines.sglang.launch import build_launch_argv
from draftline.engines.sglang.preflight import MeasuredChain, PreflightError, has_errors, preflight, preflight_report
from draftline.engines.sglang.rules import VERSION_TABLE, behaviour_for

VERSIONS = [row.checked_version for row in VERSION_TABLE]
LAUNCH = ["python", "-m", "sglang.launch_server"]
# Model paths written as hub ids: checkpoint rules only read local directories.
BASE = [*LAUNCH, "--model-path", "org/target", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "org/draft"]
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


def rules_of(findings, level=None) -> set[str]:
    return {f.rule for f in findings if level is None or f.level == level}


def only(findings, rule):
    found = [f for f in findings if f.rule == rule]
    assert found, f"no {rule} finding in {[str(f) for f in findings]}"
    return found[0]


# --- the incident this module exists for ----------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_incident_step1_vllm_num_speculative_tokens(version):
    findings = preflight([*BASE, "--num-speculative-tokens", "16"], version)
    finding = only(findings, "vllm-flag")
    assert finding.level == "error" and finding.flags == ("--num-speculative-tokens",)
    assert "--speculative-num-steps 16 --speculative-eagle-topk 1 --speculative-num-draft-tokens 17" in finding.fix
    assert has_errors(findings)


@pytest.mark.parametrize("version", VERSIONS)
def test_incident_step2_draft_tokens_without_steps_is_the_bare_assertion(version):
    findings = preflight([*BASE, "--speculative-num-draft-tokens", "16"], version)
    finding = only(findings, "partial-speculative-triple")
    assert finding.level == "error"
    assert "--speculative-num-draft-tokens" in finding.flags and "--speculative-num-steps" in finding.flags
    assert "AssertionError" in finding.message
    assert "--speculative-num-steps 15 --speculative-eagle-topk 1 --speculative-num-draft-tokens 16" in finding.fix


@pytest.mark.parametrize("version", VERSIONS)
def test_incident_fixed_command_passes(version):
    fixed = [*BASE, "--speculative-num-steps", "15", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "16"]
    assert preflight(fixed, version) == []


# --- valid commands pass untouched -----------------------------------------------------------------------


VALID = {
    "chain": [*BASE, *CHAIN],
    "tree_flashinfer_paged": [
        *BASE, "--speculative-num-steps", "5", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8",
        "--page-size", "16", "--attention-backend", "flashinfer", "--tp-size", "2", "--mem-fraction-static", "0.8",
    ],  # fmt: skip
    "inline_values": ["--model-path=org/target", "--speculative-algorithm=EAGLE3", "--speculative-draft-model-path=org/draft",
                      "--speculative-num-steps=2", "--speculative-eagle-topk=1", "--speculative-num-draft-tokens=3"],  # fmt: skip
    "no_speculation": [*LAUNCH, "--model-path", "org/target", "--port", "30001", "--trust-remote-code"],
    "ngram": [*LAUNCH, "--model-path", "org/target", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"],
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_commands_have_no_findings(name, version):
    assert preflight(VALID[name], version) == [], name


def test_command_given_as_one_shell_string():
    assert preflight(" ".join(VALID["chain"]), "0.5.23") == []
    assert has_errors(preflight("SGLANG_ENABLE_SPEC_V2=1 " + " ".join([*BASE, "--num-speculative-tokens", "3"]), "0.5.23"))


# --- one test per rule -----------------------------------------------------------------------------------


def test_unknown_flag_with_did_you_mean():
    finding = only(preflight([*BASE, *CHAIN, "--mem-fraction-statik", "0.8"], "0.5.23"), "unknown-flag")
    assert finding.level == "error" and finding.flags == ("--mem-fraction-statik",)
    assert "--mem-fraction-static" in finding.fix


def test_ambiguous_abbreviation_is_an_error():
    finding = only(preflight([*BASE, *CHAIN, "--speculative-num", "3"], "0.5.23"), "unknown-flag")
    assert "ambiguous" in finding.message and "--speculative-num-steps" in finding.message


def test_unique_abbreviation_is_a_warning_and_still_understood():
    argv = [*LAUNCH, "--model-path", "org/target", "--speculative-algo", "EAGLE3", "--speculative-draft-model-path", "org/draft", *CHAIN]
    findings = preflight(argv, "0.5.23")
    assert rules_of(findings) == {"abbreviated-flag"}
    assert only(findings, "abbreviated-flag").fix == "spell it out: --speculative-algorithm"


@pytest.mark.parametrize(
    "vllm_argv, expected_fix",
    [
        (["--speculative-model", "org/d2"], "--speculative-draft-model-path org/d2"),
        (["--gpu-memory-utilization", "0.9"], "--mem-fraction-static 0.9"),
        (["--max-model-len", "4096"], "--context-length 4096"),
        (["--speculative-draft-tensor-parallel-size", "1"], "remove it"),
    ],
)
def test_vllm_names_are_mapped(vllm_argv, expected_fix):
    finding = only(preflight([*BASE, *CHAIN, *vllm_argv], "0.5.23"), "vllm-flag")
    assert finding.level == "error" and expected_fix in finding.fix


def test_vllm_speculative_config_json_is_translated():
    config = json.dumps({"method": "eagle3", "model": "org/d3", "num_speculative_tokens": 5})
    argv = [*LAUNCH, "--model-path", "org/target", "--speculative-config", config]
    finding = only(preflight(argv, "0.5.23"), "vllm-flag")
    assert finding.fix == (
        "replace it with --speculative-algorithm EAGLE3 --speculative-draft-model-path org/d3 "
        "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6"
    )
    broken = only(preflight([*LAUNCH, "--model-path", "m", "--speculative-config", "{method: eagle3}"], "0.5.23"), "vllm-flag")
    assert "not valid JSON" in broken.message


def test_stray_value():
    finding = only(preflight([*BASE, *CHAIN, "--trust-remote-code", "true"], "0.5.23"), "stray-value")
    assert finding.flags == ("true",)


@pytest.mark.parametrize(
    "extra, text",
    [
        (["--page-size"], "needs a value"),
        (["--page-size", "big"], "takes an int"),
        (["--attention-backend", "flashinfr"], "did you mean flashinfer"),
        (["--trust-remote-code=yes"], "takes no value"),
    ],
)
def test_flag_values(extra, text):
    finding = only(preflight([*BASE, *CHAIN, *extra], "0.5.23"), "flag-value")
    assert finding.level == "error" and text in finding.message + " " + finding.fix


def test_duplicate_flag_warns_last_wins():
    findings = preflight([*BASE, *CHAIN, "--port", "1", "--port", "2"], "0.5.23")
    finding = only(findings, "duplicate-flag")
    assert finding.level == "warning" and finding.fix == "keep one: --port 2"


def test_deprecated_flag_names_replacement():
    finding = only(preflight([*BASE, *CHAIN, "--enable-dp-attention"], "0.5.23"), "deprecated-flag")
    assert finding.level == "warning" and "--attn-dp-size" in finding.fix


def test_required_model_path():
    finding = only(preflight([*LAUNCH, "--port", "30000"], "0.5.23"), "required-flag")
    assert finding.flags == ("--model-path",)


def test_unknown_algorithm_name_suggests():
    finding = only(preflight([*LAUNCH, "--model-path", "m", "--speculative-algorithm", "EAGEL3", *CHAIN], "0.5.23"), "algorithm-name")
    assert finding.level == "error" and "EAGLE3" in finding.fix


def test_speculative_flags_without_algorithm_are_ignored_by_sglang():
    finding = only(preflight([*LAUNCH, "--model-path", "m", *CHAIN], "0.5.23"), "speculative-without-algorithm")
    assert finding.level == "warning" and "--speculative-num-steps" in finding.flags


@pytest.mark.parametrize("version", VERSIONS)
def test_partial_triple_topk_only(version):
    finding = only(preflight([*BASE, "--speculative-eagle-topk", "4"], version), "partial-speculative-triple")
    assert "--speculative-eagle-topk" in finding.flags


@pytest.mark.parametrize("version", VERSIONS)
def test_steps_without_topk_is_a_type_error(version):
    finding = only(preflight([*BASE, "--speculative-num-steps", "3"], version), "steps-without-topk")
    assert finding.level == "error" and "TypeError" in finding.message
    assert "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in finding.fix


def test_topk1_draft_tokens_rewritten_is_a_warning():
    argv = [*BASE, "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "8"]
    findings = preflight(argv, "0.5.23")
    finding = only(findings, "topk1-draft-tokens")
    assert finding.level == "warning" and "to num_steps + 1 = 4" in finding.message
    assert not has_errors(findings)


def test_tree_capacity():
    # 3 steps x topk 2: 1 + 2 + 2*4 = 11 nodes.
    ok = [*BASE, "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "11"]
    assert preflight(ok, "0.5.23") == []
    too_many = ok[:-1] + ["12"]
    finding = only(preflight(too_many, "0.5.23"), "draft-tokens-exceed-tree")
    assert "= 11" in finding.message


def test_tree_without_draft_tokens():
    argv = [*BASE, "--speculative-num-steps", "3", "--speculative-eagle-topk", "2"]
    assert only(preflight(argv, "0.5.23"), "tree-without-draft-tokens").level == "error"


def test_trtllm_mha_with_tree():
    argv = [*BASE, "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6",
            "--decode-attention-backend", "trtllm_mha"]  # fmt: skip
    finding = only(preflight(argv, "0.5.23"), "trtllm-mha-topk")
    assert "--decode-attention-backend" in finding.flags


def test_page_size_tree_backend_unspecified_is_a_warning():
    argv = [*BASE, "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6", "--page-size", "16"]
    assert only(preflight(argv, "0.5.23"), "page-size-tree-backend").level == "warning"


def test_eagle3_without_draft_path():
    argv = [*LAUNCH, "--model-path", "org/target", "--speculative-algorithm", "EAGLE3", *CHAIN]
    finding = only(preflight(argv, "0.5.23"), "eagle3-without-draft")
    assert finding.level == "error" and "target itself" in finding.message


def test_auto_params_warning_names_version_choice():
    argv = [*BASE]
    assert "(5, 4, 8)" in only(preflight(argv, "0.5.12"), "auto-speculative-params").message
    assert "(3, 1, 4)" in only(preflight(argv, "0.5.23"), "auto-speculative-params").message


# --- version differences -----------------------------------------------------------------------------------


def test_algorithm_case_is_version_dependent():
    argv = [*LAUNCH, "--model-path", "m", "--speculative-algorithm", "eagle3", "--speculative-draft-model-path", "d", *CHAIN]
    assert "algorithm-name" in rules_of(preflight(argv, "0.5.6"), "error")  # argparse choices, case sensitive
    assert preflight(argv, "0.5.12") == []  # upper-cased by SGLang
    assert preflight(argv, "0.5.23") == []


def test_algorithms_added_in_later_versions():
    dflash = [*LAUNCH, "--model-path", "m", "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "d"]
    assert "algorithm-name" in rules_of(preflight(dflash, "0.5.6"))
    assert "algorithm-name" not in rules_of(preflight(dflash, "0.5.12"))
    dspark = [*LAUNCH, "--model-path", "m", "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", "d"]
    assert "algorithm-name" in rules_of(preflight(dspark, "0.5.12"))
    assert "algorithm-name" not in rules_of(preflight(dspark, "0.5.23"))


def test_triton_paged_tree_allowed_from_0_5_23():
    argv = [*BASE, "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6",
            "--page-size", "16", "--attention-backend", "triton"]  # fmt: skip
    assert "page-size-tree-backend" in rules_of(preflight(argv, "0.5.12"), "error")
    assert preflight(argv, "0.5.23") == []


def test_adaptive_skips_the_assert_only_from_0_5_23():
    argv = [*BASE, "--speculative-adaptive", "--speculative-num-draft-tokens", "4"]
    assert "partial-speculative-triple" in rules_of(preflight(argv, "0.5.12"))
    assert "partial-speculative-triple" not in rules_of(preflight(argv, "0.5.23"))
    assert "unknown-flag" in rules_of(preflight(argv, "0.5.6"))  # --speculative-adaptive does not exist yet


def test_flag_tables_differ_by_version():
    assert "--speculative-adaptive" not in flag_table_for("0.5.6").flags
    assert "--speculative-adaptive" in flag_table_for("0.5.12").flags
    assert "--speculative-ngram-min-match-window-size" in flag_table_for("0.5.6").flags
    assert "--speculative-ngram-min-match-window-size" not in flag_table_for("0.5.23").flags


def test_every_release_has_its_table_and_its_generation_of_rules():
    assert preflight(VALID["chain"], "0.5.15") == []
    assert flag_table_for("0.5.15").version == "0.5.15"
    assert behaviour_for("0.5.15").checked_version == "0.5.13"
    assert behaviour_for("0.5.10").checked_version == "0.5.12"
    assert behaviour_for("0.5.21").checked_version == "0.5.23"
    report = preflight_report(VALID["chain"], "0.5.15")
    assert "flags of release 0.5.15" in report.applied and "rules of 0.5.13 up to 0.5.20" in report.applied


def test_release_without_a_table_is_reported_and_uses_nearest_lower_rules():
    findings = preflight(VALID["chain"], "0.5.24")
    assert rules_of(findings) == {"unchecked-version"}
    assert "0.5.23" in findings[0].message
    with pytest.raises(ValueError, match="MAJOR.MINOR.PATCH"):
        preflight(VALID["chain"], "latest")


def test_argv_reader_mirrors_argparse_nargs():
    parsed = read_argv([*LAUNCH, "--model-path", "m", "--lora-paths", "a", "b", "--port", "-1", "--trust-remote-code"], flag_table_for("0.5.23"))
    assert parsed.launcher == LAUNCH
    assert parsed.last("lora_paths").values == ["a", "b"]
    assert parsed.value("port") == "-1"  # a negative number is a value, as in argparse
    assert parsed.flag_set("trust_remote_code")


# --- draft vs target checkpoints -------------------------------------------------------------------------------


def write_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A valid safetensors file with int64 zeros (the preflight reads only the header)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = 8
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": "I64", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def make_target(root: Path, num_layers=6, hidden=192, vocab=2048) -> Path:
    target = root / "target"
    target.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": num_layers, "hidden_size": hidden, "vocab_size": vocab}
    (target / "config.json").write_text(json.dumps(config))
    return target


def make_draft(root: Path, d2t_len=1024, aux=(1, 2, 3), **overrides) -> Path:
    draft = root / "draft"
    draft.mkdir()
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 192, "vocab_size": 2048, "draft_vocab_size": 1024,
        "target_hidden_size": 192, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)},
    }  # fmt: skip
    config.update(overrides)
    (draft / "config.json").write_text(json.dumps(config))
    write_safetensors(draft / "model.safetensors", {"d2t": [d2t_len], "fc.weight": [2, 3]})
    return draft


def local_argv(target: Path, draft: Path) -> list[str]:
    return [*LAUNCH, "--model-path", str(target), "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft), *CHAIN]


def test_matching_checkpoints_pass(tmp_path):
    assert preflight(local_argv(make_target(tmp_path), make_draft(tmp_path)), "0.5.23") == []


@pytest.mark.parametrize(
    "draft_kwargs, rule",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "draft-architecture"),
        ({"d2t_len": 1000}, "draft-vocab-d2t"),
        ({"target_hidden_size": 256}, "draft-target-hidden-size"),
        ({"aux": (1, 2, 5)}, "aux-layer-ids"),  # id 5 would capture layer 6's input: 6 layers have none
        ({"aux": (-1, 2, 3)}, "aux-layer-ids"),
        ({"vocab_size": 32000}, "draft-target-vocab"),
    ],
)
def test_checkpoint_mismatches(tmp_path, draft_kwargs, rule):
    target = make_target(tmp_path)
    draft = make_draft(tmp_path, **draft_kwargs)
    finding = only(preflight(local_argv(target, draft), "0.5.23"), rule)
    assert "--speculative-draft-model-path" in finding.flags, finding  # names the flag whose checkpoint is wrong


def test_aux_layer_count_fixed_at_three_in_0_5_6(tmp_path):
    argv = local_argv(make_target(tmp_path), make_draft(tmp_path, aux=(1, 2)))
    assert "aux-layer-count" in rules_of(preflight(argv, "0.5.6"), "error")
    assert preflight(argv, "0.5.23") == []


def test_missing_local_checkpoint_dir_is_reported(tmp_path):
    argv = local_argv(make_target(tmp_path), tmp_path / "no-such-draft")
    finding = only(preflight(argv, "0.5.23"), "checkpoint-unreadable")
    assert finding.level == "warning" and "no such local directory" in finding.message
    assert preflight(argv, "0.5.23", check_checkpoints=False) == []


# --- the generator --------------------------------------------------------------------------------------------


def tiny_cfg(*overrides):
    return load_config(None, list(overrides))


@pytest.mark.parametrize("version", VERSIONS)
def test_build_launch_argv_passes_its_own_preflight(version):
    cfg = tiny_cfg(f"engine.sglang.version={version}", "engine.sglang.mem_fraction_static=0.8", "engine.sglang.page_size=1")
    argv = build_launch_argv(cfg, "org/target", "org/draft")
    assert argv[:3] == [cfg.engine.sglang.python, "-m", "sglang.launch_server"]
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == str(cfg.engine.speculative.num_draft_tokens)
    assert preflight(argv, version) == []


def test_build_launch_argv_refuses_a_failing_config():
    cfg = tiny_cfg("engine.speculative.eagle_topk=2", "engine.speculative.num_draft_tokens=40")
    with pytest.raises(PreflightError) as err:
        build_launch_argv(cfg, "org/target", "org/draft")
    assert "draft-tokens-exceed-tree" in {f.rule for f in err.value.findings}
    with pytest.raises(PreflightError, match="eagle3-without-draft"):
        build_launch_argv(tiny_cfg(), "org/target", None)


def test_build_launch_argv_validates_extra_args():
    cfg = tiny_cfg()
    cfg.engine.sglang.extra_args = ["--num-speculative-tokens", "4"]
    with pytest.raises(PreflightError, match="vllm-flag"):
        build_launch_argv(cfg, "org/target", "org/draft")


MEASURED = MeasuredChain(SpeculativeConfig(num_steps=4, eagle_topk=1, num_draft_tokens=5), "measured fastest for model m version 3 at concurrency 1 by `draftline bench --sweep`")


@pytest.mark.parametrize("written", [["--speculative-num-draft-tokens", "16"], ["--num-speculative-tokens", "16"],
                                     ["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 16}'],
                                     ["--speculative-num-steps", "15"]])
def test_a_fix_that_writes_a_chain_proposes_the_drafters_measured_settings_not_the_commands_number(written):
    """The seed's command wrote 16 and the fix proposed a 15-step chain whatever the drafter accepts; with the
    version's measured sweep the fix proposes what was measured fastest, and says where the figures come from."""
    fixes = [f.fix for f in preflight([*BASE, *written], "0.5.23", measured=MEASURED) if f.level == "error"]
    assert fixes and all(MEASURED.proposal() in fix for fix in fixes), fixes
    assert not any("num-steps 15 " in fix or "num-steps 16 " in fix for fix in fixes), fixes
    assert preflight([*BASE, *written], "0.5.23") != preflight([*BASE, *written], "0.5.23", measured=MEASURED)
