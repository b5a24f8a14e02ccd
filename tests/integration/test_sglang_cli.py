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
