"""Data prep on the tiny target: splits, masks, vocab, and bad input (file + line, counted, skip or fail)."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import time

import pytest
import torch

import draftline.data.prepare as prepare_module
from draftline.config import ConfigError
from draftline.data.conversations import DataError, read_conversations
from draftline.data.prepare import load_split, load_vocab, prepare
from draftline.data.vocab import save_vocab
from draftline.utils import StorageFullError, read_json
from conftest import make_test_config

GOOD = {"messages": [{"role": "user", "content": "What does `def f(x)` do?"}, {"role": "assistant", "content": "Return the value."}]}


def _write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def test_prepare_tiny_target(tiny_cfg, tiny_dataset_dir):
    report = read_json(tiny_dataset_dir / "report.json")
    assert report["bad_input"]["count"] == 0
    train = load_split(tiny_dataset_dir, "train")
    assert len(train) == report["samples"]["train"] > 0
    assert all(len(s["input_ids"]) == len(s["loss_mask"]) and any(s["loss_mask"]) for s in train)
    d2t, t2d = load_vocab(tiny_dataset_dir)
    assert d2t.shape[0] == tiny_cfg.data.draft_vocab_size and int(t2d.sum()) == tiny_cfg.data.draft_vocab_size
    assert (tiny_dataset_dir / "resolved_config.yaml").exists()
    # Splits are disjoint and stable.
    ids = {split: {s["id"] for s in load_split(tiny_dataset_dir, split)} for split in ("train", "val", "bench")}
    assert not ids["train"] & ids["val"] and not ids["train"] & ids["bench"]


def test_second_prepare_is_cached(tiny_cfg, tiny_target_dir, tiny_dataset_dir):
    assert prepare(tiny_cfg, tiny_target_dir) == tiny_dataset_dir


BAD_LINES = [
    GOOD,
    "{not json",
    {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": "only a question"}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Return the value."}]},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "word " * 400}]},
]


def test_two_processes_preparing_one_dataset_build_it_once(tmp_path, tiny_target_dir):
    """utils.build_lock: two draftline processes on one data_dir (two runs, parallel tests). Without the lock both
    build and the second replaces the directory under the first's readers; with it the second waits and reuses."""
    import sys

    script = ("import sys; from conftest import make_test_config; from draftline.data.prepare import prepare; "
              f"print('OUT', prepare(make_test_config(sys.argv[1]), {str(tiny_target_dir)!r}))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    dirs = {line.split(" ", 1)[1] for out in outputs for line in out.splitlines() if line.startswith("OUT ")}
    assert len(dirs) == 1, outputs
    assert sum("[prepare] cached:" in out for out in outputs) == 1, outputs  # one built it, the other found it built
    assert load_split(dirs.pop(), "train")


def test_reader_names_file_and_line(tmp_path):
    path = _write(tmp_path / "conv.jsonl", BAD_LINES)
    good, bad = read_conversations(path)
    assert [c.line for c in good] == [1, 5, 6]
    assert good[1].messages[1] == {"role": "assistant", "content": "Return the value."}
    assert [(b.line, b.kind) for b in bad] == [(2, "malformed"), (3, "unknown_role"), (4, "no_assistant")]
    assert all(str(path) in str(b) for b in bad)
    assert "wizard" in str(bad[1]) and "allowed" in str(bad[1])


def test_parquet_input(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "conv.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "a", **GOOD}]), path)
    good, bad = read_conversations(path)
    assert not bad and good[0].id == "a" and good[0].messages == GOOD["messages"]


def test_skip_policy_counts_every_problem(tmp_path, tiny_target_dir):
    path = _write(tmp_path / "conv.jsonl", BAD_LINES * 3)
    cfg = make_test_config(tmp_path / "dd", [f"data.conversations={path}", "data.max_seq_len=64", "data.over_length=skip",
                                             "data.split.val_fraction=0.0", "data.split.bench_fraction=0.0", "data.draft_vocab_size=64"])
    out = prepare(cfg, tiny_target_dir)
    report = read_json(out / "report.json")
    assert report["bad_input"]["by_kind"] == {"malformed": 3, "unknown_role": 3, "no_assistant": 3, "over_length": 3}
    assert report["bad_input"]["count"] == 12 and len(report["bad_input"]["items"]) == 12
    assert report["samples"]["train"] == 6  # GOOD and its ShareGPT twin, three copies each (ids default to file:line)
    assert report["records_read"] == 18


def test_duplicate_ids_are_reported(tmp_path, tiny_target_dir):
    path = _write(tmp_path / "conv.jsonl", [{"id": "same", **GOOD}, {"id": "same", **GOOD}])
    cfg = make_test_config(tmp_path / "dd", [f"data.conversations={path}", "data.split.val_fraction=0.0",
                                             "data.split.bench_fraction=0.0", "data.draft_vocab_size=64"])
    report = read_json(prepare(cfg, tiny_target_dir) / "report.json")
    assert report["samples"]["train"] == 1
    assert report["bad_input"]["items"] == [f"{path}:2: bad_field: duplicate id 'same'; ids must be unique"]


def test_fail_policy_lists_all_problems(tmp_path, tiny_target_dir):
    path = _write(tmp_path / "conv.jsonl", BAD_LINES)
    cfg = make_test_config(tmp_path / "dd", [f"data.conversations={path}", "data.on_bad_input=fail"])
    with pytest.raises(DataError) as err:
        prepare(cfg, tiny_target_dir)
    msg = str(err.value)
    assert f"{path}:2: malformed" in msg and f"{path}:3: unknown_role" in msg and f"{path}:4: no_assistant" in msg
    assert "data.on_bad_input=skip" in msg
    assert not (tmp_path / "dd" / "datasets").exists() or not any((tmp_path / "dd" / "datasets").glob("*/manifest.json"))


def test_over_length_truncate_and_fail(tmp_path, tiny_target_dir):
    path = _write(tmp_path / "conv.jsonl", [BAD_LINES[5], GOOD])
    cfg = make_test_config(tmp_path / "a", [f"data.conversations={path}", "data.max_seq_len=64", "data.split.val_fraction=0.0",
                                            "data.split.bench_fraction=0.0", "data.draft_vocab_size=64"])
    report = read_json(prepare(cfg, tiny_target_dir) / "report.json")
    assert report["truncated"] == 1 and report["samples"]["train"] == 2
    cfg = make_test_config(tmp_path / "b", [f"data.conversations={path}", "data.max_seq_len=64", "data.over_length=fail"])
    with pytest.raises(DataError, match="conv.jsonl:1: over_length"):
        prepare(cfg, tiny_target_dir)


def test_skip_policy_survives_non_utf8_deep_nesting_and_a_bom(tmp_path, tiny_target_dir):
    """Faults 6 and 11: one non-UTF-8 line aborted prepare with a codec error naming neither file nor line; a line
    nested 100k deep raised RecursionError; a UTF-8 BOM made line 1 'malformed'."""
    path = tmp_path / "conv.jsonl"
    good = json.dumps(GOOD).encode()
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + b'{"messages": "caf\xe9"}\n' + b"[" * 100_000 + b"\n" + good + b"\n")
    conversations, bad = read_conversations(path)
    assert [c.line for c in conversations] == [1, 4]
    assert [(b.line, b.kind) for b in bad] == [(2, "malformed"), (3, "malformed")]
    assert "not UTF-8" in bad[0].message and "nested too deeply" in bad[1].message
    cfg = make_test_config(tmp_path / "dd", [f"data.conversations={path}", "data.split.val_fraction=0.0",
                                             "data.split.bench_fraction=0.0", "data.draft_vocab_size=64"])
    report = read_json(prepare(cfg, tiny_target_dir) / "report.json")
    assert report["bad_input"]["by_kind"] == {"malformed": 2}
    assert any(f"{path}:2: malformed: not UTF-8" in item for item in report["bad_input"]["items"])


def test_conversations_pointing_at_a_directory_names_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"data.conversations=.* is a directory; point it at one .jsonl"):
        read_conversations(tmp_path)


FULL_DISK_FIX = r"MB free there\); free space or point data_dir at a writable disk with room, then rerun$"


@pytest.mark.parametrize("error_number", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_gives_one_line_and_leaves_no_dataset_that_looks_finished(tmp_path, tiny_target_dir, monkeypatch,
                                                                              error_number):
    """A write that fails for want of space raised a bare OSError (a traceback); now one line naming the file, the
    free space and the fix, the half-written temp directory removed, and a rerun after freeing space completes."""
    conversations = _write(tmp_path / "conv.jsonl", [GOOD] * 20)
    cfg = make_test_config(tmp_path / "dd", [f"data.conversations={conversations}", "data.draft_vocab_size=64"])
    real_open = open

    def disk_fills_at_val_jsonl(path, *args, **kwargs):
        if os.path.basename(path) == "val.jsonl":
            raise OSError(error_number, os.strerror(error_number))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(prepare_module, "open", disk_fills_at_val_jsonl, raising=False)
    with pytest.raises(StorageFullError) as raised:
        prepare(cfg, tiny_target_dir)
    message = str(raised.value)
    assert "\n" not in message
    assert re.match(rf"cannot write {tmp_path}/dd/datasets/\.\w+\.tmp-\d+/val\.jsonl: {os.strerror(error_number)} "
                    rf"\(\d+\.\d {FULL_DISK_FIX}", message), message
    # Only the build lock (utils.build_lock) may stay: nothing half-written.
    assert [n for n in os.listdir(tmp_path / "dd" / "datasets") if not n.endswith(".lock")] == []

    monkeypatch.undo()
    out = prepare(cfg, tiny_target_dir)
    assert read_json(out / "manifest.json")["samples"]["train"] == len(load_split(out, "train")) > 0


def test_a_full_tmpfs_fails_in_one_line_and_a_rerun_with_room_completes(tmp_path, tiny_target_dir, one_mb_tmpfs):
    """The same on a real 1 MB file system: about 3 MB of samples do not fit."""
    reply = {"role": "assistant", "content": "It returns the value of x, unchanged, to the caller. " * 4}
    conversations = _write(tmp_path / "conv.jsonl", [{"messages": [GOOD["messages"][0], reply]}] * 2000)
    cfg = make_test_config(one_mb_tmpfs / "dd", [f"data.conversations={conversations}", "data.draft_vocab_size=64"])
    started = time.monotonic()
    with pytest.raises(StorageFullError) as raised:
        prepare(cfg, tiny_target_dir)
    print(f"full disk reported after {time.monotonic() - started:.1f} s: {raised.value}")
    assert re.match(rf"cannot write {one_mb_tmpfs}/dd/datasets/\S+: No space left on device \(0\.\d {FULL_DISK_FIX}",
                    str(raised.value))
    assert [n for n in os.listdir(one_mb_tmpfs / "dd" / "datasets") if not n.endswith(".lock")] == []

    subprocess.run(["mount", "-o", "remount,size=16m", str(one_mb_tmpfs)], check=True)
    out = prepare(cfg, tiny_target_dir)
    assert len(load_split(out, "train")) == read_json(out / "manifest.json")["samples"]["train"] > 1000


def test_a_kept_draft_vocab_is_used_as_is_and_one_of_another_size_is_refused(tmp_path, tiny_target_dir, tiny_dataset_dir):
    """data.draft_vocab_file (draftline refresh keeps its champion's vocab): the dataset's vocab is that file's, not
    one built from its own train split; a vocab of another size names the field and the fix."""
    d2t, t2d = load_vocab(tiny_dataset_dir)
    kept = tmp_path / "vocab.safetensors"
    save_vocab(kept, d2t, t2d)
    path = _write(tmp_path / "conv.jsonl", [{"id": f"c{i}", **GOOD} for i in range(3)])
    cfg = make_test_config(tmp_path / "dd", [f"data.conversations={path}", "data.split.val_fraction=0.0",
                                             "data.split.bench_fraction=0.0", f"data.draft_vocab_file={kept}"])
    out = prepare(cfg, tiny_target_dir)
    got_d2t, got_t2d = load_vocab(out)
    assert torch.equal(got_d2t, d2t) and torch.equal(got_t2d, t2d)
    assert read_json(out / "report.json")["draft_vocab"]["kept_from"] == str(kept)
    built = prepare(make_test_config(tmp_path / "dd", [f"data.conversations={path}", "data.split.val_fraction=0.0",
                                                       "data.split.bench_fraction=0.0"]), tiny_target_dir)
    assert not torch.equal(load_vocab(built)[1], t2d)  # what the three conversations alone would have given

    smaller = make_test_config(tmp_path / "dd", [f"data.conversations={path}", f"data.draft_vocab_file={kept}",
                                                 "data.draft_vocab_size=64"])
    with pytest.raises(ConfigError, match=r"data.draft_vocab_file=.*maps 512 draft tokens.*data.draft_vocab_size is 64"):
        prepare(smaller, tiny_target_dir)
