"""Config loading: YAML + dotted overrides, strict fields, errors that name file, line and field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from draftline.config import ConfigError, check_data_dir, load_config
from conftest import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.name


def test_production_configs_have_real_shapes():
    llama = load_config(REPO / "configs" / "llama3.1-8b-4xgpu.yaml")
    assert (llama.target.hidden_size, llama.target.vocab_size, llama.target.num_layers) == (4096, 128256, 32)
    assert llama.train.num_workers == 4 and llama.train.use_gpu and llama.train.dtype == "bfloat16"
    assert llama.extract.aux_layer_ids == [1, 15, 28]
    kimi = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    assert kimi.target.hidden_size == 7168 and kimi.train.num_workers == 4


def test_override_changes_nested_value_and_type():
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", ["train.lr=1e-4", "bench.concurrency=[1,2,8]"])
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.bench.concurrency == [1, 2, 8]


def test_unknown_field_names_file_line_and_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ntrain:\n  lr: 0.1\n  learning_rate: 0.2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert str(path) in msg and "line 4" in msg and "train.learning_rate" in msg and "unknown field" in msg


def test_bad_value_from_override_is_attributed_to_the_override():
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "tiny-cpu.yaml", ["train.zero_stage=5"])
    assert "train.zero_stage" in str(err.value) and "command-line override" in str(err.value)


def test_malformed_override_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["train.lr"])
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  lr: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="val_fraction \\+ bench_fraction"):
        load_config(None, ["data.split.val_fraction=0.6", "data.split.bench_fraction=0.5"])
    with pytest.raises(ConfigError, match="target.path"):
        load_config(None, ["target.kind=hf"])


def test_dry_run_prints_resolved_config_and_stages():
    out = subprocess.run(
        [sys.executable, "-m", "draftline.cli", "run", "--config", str(REPO / "configs" / "tiny-cpu.yaml"), "--dry-run", "train.max_steps=7"],
        capture_output=True, text=True, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert "max_steps: 7" in out.stdout and "bootstrap" in out.stdout and "train" in out.stdout


def test_dry_run_fails_on_config_error():
    out = subprocess.run(
        [sys.executable, "-m", "draftline.cli", "run", "--config", str(REPO / "configs" / "tiny-cpu.yaml"), "--dry-run", "train.nope=1"],
        capture_output=True, text=True, cwd=REPO,
    )
    assert out.returncode == 2 and "train.nope" in out.stderr


def test_duplicate_yaml_keys_are_refused_with_both_lines(tmp_path):
    """Fault 11: PyYAML keeps the last of two equal keys silently."""
    path = tmp_path / "dup.yaml"
    path.write_text("seed: 1\ntrain:\n  lr: 0.001\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"dup.yaml line 4: duplicate key 'train.lr' \(first at line 3\)"):
        load_config(path)


@pytest.mark.parametrize("make_bad", [
    lambda tmp: (tmp / "a-file").write_text("x") and tmp / "a-file",
    lambda tmp: (tmp / "a-file").write_text("x") and tmp / "a-file" / "below",
])
def test_data_dir_that_is_a_file_or_unwritable_fails_before_any_stage(tmp_path, make_bad):
    """Fault 9: found only after the ~4-minute bootstrap, as a raw traceback. Now: exit 2 in about a second."""
    data_dir = make_bad(tmp_path)
    out = subprocess.run([sys.executable, "-m", "draftline.cli", "run", "-c", str(REPO / "configs" / "tiny-cpu.yaml"),
                          f"data_dir={data_dir}"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"data_dir={data_dir}" in out.stderr and "set data_dir to a directory you can write" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc and /sys")
@pytest.mark.parametrize("data_dir", ["/proc/draftline-data", "/sys/draftline-data/below"])
def test_data_dir_where_nothing_can_be_created_is_refused_even_for_root(data_dir):
    """Fault 9: the permission-bit check let root through to places where no directory can be made (/proc, /sys)."""
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", [f"data_dir={data_dir}"])
    with pytest.raises(ConfigError, match=rf"^data_dir={data_dir} .*: cannot create anything in /(proc|sys) .*; set "
                                          r"data_dir to a directory you can write"):
        check_data_dir(cfg)


def test_data_dir_check_leaves_nothing_behind(tmp_path):
    check_data_dir(load_config(REPO / "configs" / "tiny-cpu.yaml", [f"data_dir={tmp_path / 'new' / 'data'}"]))
    assert list(tmp_path.iterdir()) == []


def test_nothing_shipped_points_users_at_a_design_md_they_do_not_have():
    """Fault 9: code and error messages cited DESIGN.md, which is not part of the project; docs/ is."""
    folders = ("platform", "serve", "jobs", "configs", "docs", "scripts")
    shipped = [p for folder in folders for p in (REPO / folder).rglob("*") if p.suffix in {".py", ".md", ".yaml", ".sh"}]
    assert len(shipped) > 50
    citing = [str(p.relative_to(REPO)) for p in shipped + [REPO / "README.md"] if "DESIGN.md" in p.read_text()]
    assert citing == []


def test_mlflow_params_never_carry_credentials_from_a_uri():
    """Fault 12: tracking.tracking_uri was logged verbatim as an MLflow param."""
    from draftline.train.run import flatten

    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", ["tracking.tracking_uri=https://alice:s3cret@mlflow.example:5000/x"])
    params = flatten(cfg.model_dump(mode="json"))
    assert params["tracking.tracking_uri"] == "https://alice:***@mlflow.example:5000/x"
    assert not any("s3cret" in value for value in params.values())
