"""Config loading: YAML + dotted overrides, strict fields, errors that name file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftline.cli import main
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


def test_dry_run_prints_resolved_config_and_stages(capsys):
    assert main(["run", "--config", str(REPO / "configs" / "tiny-cpu.yaml"), "--dry-run", "train.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 7" in out and "bootstrap" in out and "train" in out


def test_dry_run_fails_on_config_error(capsys):
    assert main(["run", "--config", str(REPO / "configs" / "tiny-cpu.yaml"), "--dry-run", "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err


def test_the_config_path_may_come_first_as_the_readme_writes_it(capsys):
    """`draftline run CONFIG [KEY=VALUE ...]` and `draftline run CONFIG --dry-run`, as README and docs write them."""
    twin = REPO / "configs" / "twins" / "qwen3-8b.yaml"
    assert main(["run", str(twin), "--dry-run", "train.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 7" in out and "name: twin-qwen3-8b" in out, out[:400]
    assert main(["run", str(twin), "train.max_steps=7", "--dry-run", "--config", str(REPO / "configs" / "tiny-cpu.yaml")]) == 2
    assert "two configs: --config" in capsys.readouterr().err
    assert main(["run", "--dry-run", "train.max_steps"]) == 2  # no .yaml, no file: still an override, and a bad one
    assert "override 'train.max_steps': expected KEY=VALUE" in capsys.readouterr().err


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
def test_data_dir_that_is_a_file_or_unwritable_fails_before_any_stage(tmp_path, make_bad, capsys, monkeypatch):
    """Fault 9: found only after the ~4-minute bootstrap, as a raw traceback. Now: exit 2 before any stage."""
    import draftline.commands.run

    data_dir = make_bad(tmp_path)
    monkeypatch.setattr(draftline.commands.run, "run_pipeline", lambda *a, **k: pytest.fail("a stage started"))
    assert main(["run", "-c", str(REPO / "configs" / "tiny-cpu.yaml"), f"data_dir={data_dir}"]) == 2
    err = capsys.readouterr().err
    assert f"data_dir={data_dir}" in err and "set data_dir to a directory you can write" in err
    assert "Traceback" not in err


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


SECRET_URI = "https://alice:s3cret@mlflow.example:5000/x?token=t0k3n&api_key=k3y&workspace=1"
SHOWN_URI = "https://alice:***@mlflow.example:5000/x?token=***&api_key=***&workspace=1"


def test_credentials_in_a_uri_never_reach_params_files_console_or_serve(tmp_path, capsys):
    """Fault 12: tracking.tracking_uri was logged verbatim as an MLflow param; it was also written verbatim to
    resolved_config.yaml beside outputs, printed by --dry-run, named in registry errors and stored in Serve's app
    config (the dashboard shows it). One rule (utils.redact_uri_credentials), applied by config.shown_config."""
    from draftline.config import write_resolved
    from draftline.serving.control import app_config
    from draftline.serving.served_model import ServedModel
    from draftline.train.run import config_params

    override = f"tracking.tracking_uri={SECRET_URI}"
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", [override])
    secrets = ("s3cret", "t0k3n", "k3y")

    params = config_params(cfg)
    assert params["tracking.tracking_uri"] == SHOWN_URI

    written = write_resolved(cfg, tmp_path).read_text()
    assert SHOWN_URI in written
    assert load_config(tmp_path / "resolved_config.yaml").tracking.tracking_uri == SHOWN_URI

    assert cfg.mlflow_tracking_uri_shown == SHOWN_URI and cfg.mlflow_tracking_uri == SECRET_URI  # MLflow gets it whole

    served = ServedModel(registered_model=cfg.registered_model_name, model_version="1", export_dir=str(tmp_path))
    stored = json.dumps(app_config(cfg, served))

    assert main(["run", "--dry-run", "-c", str(REPO / "configs" / "tiny-cpu.yaml"), override,
                 f"data_dir={tmp_path}"]) == 0
    dry_run = capsys.readouterr()
    assert SHOWN_URI in dry_run.out
    for secret in secrets:
        assert not any(secret in value for value in params.values())
        assert secret not in written and secret not in stored
        assert secret not in dry_run.out + dry_run.err


@pytest.mark.parametrize("uri, shown", [
    ("postgresql://mlflow:pa55@db:5432/mlflow", "postgresql://mlflow:***@db:5432/mlflow"),
    ("https://h/p?X-Amz-Signature=abc&X-Amz-Credential=c&keep=1", "https://h/p?X-Amz-Signature=***&X-Amz-Credential=***&keep=1"),
    ("https://blob.example/c?sv=2022&sig=abc%3D", "https://blob.example/c?sv=2022&sig=***"),
    ("databricks://profile", "databricks://profile"),
    ("sqlite:////data/mlflow.db", "sqlite:////data/mlflow.db"),
])
def test_the_redaction_rule(uri, shown):
    from draftline.utils import redact_uri_credentials

    assert redact_uri_credentials(uri) == shown


def test_config_names_the_families_and_chat_layouts_the_target_layer_holds():
    """config.py names them without importing the target layer (layers go one way); the lists must agree."""
    from typing import get_args

    from draftline.config import ChatLayoutName, TargetFamily
    from draftline.target.chat_layouts import layout_names
    from draftline.target.families import FAMILIES

    assert sorted(get_args(TargetFamily)) == sorted(FAMILIES)
    assert sorted(get_args(ChatLayoutName)) == sorted(layout_names())
    with pytest.raises(ConfigError, match="target.embedded.family: Input should be 'llama'"):
        load_config("configs/tiny-cpu.yaml", ["target.embedded.family=gpt"])
    with pytest.raises(ConfigError, match="target.embedded.chat_template: Input should be 'draftline'"):
        load_config("configs/tiny-cpu.yaml", ["target.embedded.chat_template=chatml"])


@pytest.mark.parametrize("overrides, message", [
    (["refresh.min_records=4"], r"refresh.min_records=4 with refresh.held_out_fraction=0.2 holds out 0 request\(s\).*"
                                r"raise refresh.min_records or change refresh.held_out_fraction"),
    (["refresh.max_records=10"], r"refresh.max_records=10 < refresh.min_records=20.*raise refresh.max_records"),
    (["refresh.bench_champion_margin=0.5"], r"refresh.bench_champion_margin: Input should be less than or equal to 0"),
])
def test_a_refresh_window_that_cannot_work_is_refused_naming_the_fields_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / "tiny-cpu.yaml", overrides)
