"""`draftline sglang-command` and `draftline check-sglang-args`, through main() and one real subprocess."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from draftline.cli import main

REPO = Path(__file__).resolve().parents[2]
STORY = ["python", "-m", "sglang.launch_server", "--model-path", "org/target", "--speculative-algorithm", "EAGLE3",
         "--speculative-draft-model-path", "org/draft"]  # fmt: skip


def test_check_sglang_args_story_step1_fails(capsys):
    assert main(["check-sglang-args", "--", *STORY, "--num-speculative-tokens", "16"]) == 1
    out = capsys.readouterr().out
    assert "--num-speculative-tokens" in out and "--speculative-num-steps 16" in out


def test_check_sglang_args_story_step2_fails(capsys):
    assert main(["check-sglang-args", "--", *STORY, "--speculative-num-draft-tokens", "16"]) == 1
    assert "AssertionError" in capsys.readouterr().out


def test_check_sglang_args_clean_and_warning_exit_zero(capsys):
    chain = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
    assert main(["check-sglang-args", "--", *STORY, *chain, "--speculative-num-draft-tokens", "4"]) == 0
    assert "ok: no problems found" in capsys.readouterr().out
    assert main(["check-sglang-args", "--", *STORY, *chain, "--speculative-num-draft-tokens", "9"]) == 0
    assert "topk1-draft-tokens" in capsys.readouterr().out


def test_check_sglang_args_json_and_version(capsys):
    argv = [*STORY[:5], "--speculative-algorithm", "eagle3", "--speculative-draft-model-path", "d",
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
    assert main(["check-sglang-args", "--sglang-version", "0.5.6", "--json", "--", *argv]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [f["rule"] for f in report["findings"]] == ["algorithm-name"]
    assert report["findings"][0]["phase"] == "parse"
    assert report["applied"].startswith("SGLang 0.5.6: flags of release 0.5.6")
    assert main(["check-sglang-args", "--sglang-version", "0.5.23", "--", *argv]) == 0


def test_check_sglang_args_without_command(capsys):
    assert main(["check-sglang-args"]) == 2
    assert "after `--`" in capsys.readouterr().err


def test_sglang_command_prints_checked_command(capsys):
    code = main(["sglang-command", "--config", str(REPO / "configs/tiny-cpu.yaml"), "--model-path", "org/target",
                 "--draft-model-path", "org/draft", "--python", "python3"])  # fmt: skip
    assert code == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[:5] == ["python3", "-m", "sglang.launch_server", "--model-path", "org/target"]
    assert main(["check-sglang-args", "--", *argv]) == 0


def test_sglang_command_reports_findings_for_bad_config(capsys):
    code = main(["sglang-command", "--config", str(REPO / "configs/tiny-cpu.yaml"), "--model-path", "t",
                 "--draft-model-path", "d", "engine.sglang.extra_args=[--speculative-model, x]"])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "vllm-flag" in err and "--speculative-draft-model-path x" in err


def test_sglang_command_needs_a_draft(capsys):
    assert main(["sglang-command", "--config", str(REPO / "configs/tiny-cpu.yaml"), "--model-path", "t"]) == 2
    assert "--draft-model-path" in capsys.readouterr().err


def test_check_sglang_args_subprocess():
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "draftline.cli", "check-sglang-args", "--", *STORY, "--num-speculative-tokens", "16"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "vllm-flag" in proc.stdout


def registered_config(tmp_path: Path, sweep: dict | None) -> tuple[Path, str, Path]:
    """A config file whose MLflow store holds one drafter version (with `sweep` as its stored bench sweep) ->
    (config path, version, the version's export dir)."""
    import yaml

    from draftline.registry import get_version
    from draftline.target.load import resolve_target_dir
    from draftline.tracking import BENCH_BEST_TAG
    from registry_helpers import mlflow_test_config, random_drafter, register_drafter

    cfg = mlflow_test_config(tmp_path)
    tags = {BENCH_BEST_TAG: json.dumps(sweep)} if sweep else None
    version = register_drafter(cfg, random_drafter(resolve_target_dir(cfg)), tags=tags)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path, version, get_version(cfg, version).export_dir


SWEEP = {"1": {"num_steps": 5, "eagle_topk": 1, "num_draft_tokens": 6, "output_tokens_per_s": 90.0, "speedup": 1.4,
               "accept_length": 2.1},
         "8": {"num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3, "output_tokens_per_s": 300.0, "speedup": 1.1,
               "accept_length": 1.7}}  # fmt: skip


def test_sglang_command_for_a_version_uses_its_files_and_the_settings_its_sweep_measured(tmp_path, capsys):
    """The served configuration from measurement: `sglang-command --version N` launches the version's files with
    the steps/topk/draft tokens its bench sweep stored as fastest at the concurrency asked for; a version with no
    sweep gets the config's settings and a note that says how to measure them."""
    config, version, export_dir = registered_config(tmp_path / "swept", SWEEP)
    for concurrency, chain in (("1", ["5", "1", "6"]), ("8", ["2", "1", "3"]), ("4", ["5", "1", "6"])):
        assert main(["sglang-command", "--config", str(config), "--model-path", "t", "--version", version,
                     "--concurrency", concurrency]) == 0  # fmt: skip
        captured = capsys.readouterr()
        argv = shlex.split(captured.out.strip())
        assert argv[argv.index("--speculative-draft-model-path") + 1] == str(export_dir)
        assert [argv[argv.index(f"--speculative-{n}") + 1] for n in ("num-steps", "eagle-topk", "num-draft-tokens")] == chain
        assert f"version {version} at concurrency" in captured.err
    config, version, _ = registered_config(tmp_path / "unswept", None)
    assert main(["sglang-command", "--config", str(config), "--model-path", "t", "--version", version]) == 0
    captured = capsys.readouterr()
    argv = shlex.split(captured.out.strip())
    assert argv[argv.index("--speculative-num-steps") + 1] == "3"  # tiny-cpu.yaml's engine.speculative
    assert f"draftline bench --sweep --version {version}" in captured.err


def test_check_sglang_args_fix_proposes_the_versions_measured_settings(tmp_path, capsys):
    """The seed's story (16 draft tokens, no steps): with --version, the fix proposes what the version's sweep
    measured, not a 15-step chain."""
    config, version, _ = registered_config(tmp_path, SWEEP)
    assert main(["check-sglang-args", "--config", str(config), "--version", version, "--concurrency", "1", "--",
                 *STORY, "--speculative-num-draft-tokens", "16"]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 (measured fastest" in out
    assert "--speculative-num-steps 15" not in out
