"""A refresh's training data from the traffic store (draftline.refresh.window): dedupe, the time-ordered held-out
slice and the replay mix. The records go through the store's real writer and reader (ShardWriter, read_records);
capture from a live endpoint is tested in tests/integration/test_traffic.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from draftline.cli import main
from draftline.config import RefreshConfig, load_config
from draftline.refresh.run import RefreshError, load_window
from draftline.refresh.window import replay_sample, traffic_window
from draftline.serving.traffic_store import ShardWriter, read_records
from conftest import REPO


def _chat(i: int, time_s: float, prompt: str, reply: str = "ok", segment=None) -> dict:
    return {"id": f"r{i}", "time_s": time_s, "route": "chat", "segment": segment, "model_version": "1",
            "messages": [{"role": "user", "content": prompt}], "prompt_token_ids": [1, 2, 3 + i],
            "completion_text": reply}


def _stored(tmp_path, records: list[dict]) -> list[dict]:
    writer = ShardWriter(tmp_path / "traffic", shard_bytes=400, max_age_s=86400.0, max_total_bytes=1 << 30)
    for record in records:
        writer.append([record])
    writer.close()
    return list(read_records(tmp_path / "traffic"))


def test_the_newest_distinct_requests_are_held_out_and_a_repeated_prompt_is_kept_once_newest(tmp_path):
    # Written out of time order (two capture replicas), with prompt "p3" asked again later and one completions record.
    records = [_chat(i, 100.0 + i, f"p{i}", segment="code" if i % 2 else None) for i in range(10)]
    records.insert(4, _chat(90, 200.0, "p3", reply="newer answer"))
    records.append({"id": "c1", "time_s": 150.0, "route": "completions", "prompt": "raw", "completion_text": "x"})
    records.append(_chat(91, 160.0, "empty reply", reply=""))
    records.append({**_chat(92, 161.0, "no tokens"), "prompt_token_ids": []})
    records[0], records[5] = records[5], records[0]
    window = traffic_window(_stored(tmp_path, records), RefreshConfig(min_records=5, held_out_fraction=0.3))

    assert window.records_read == 14 and window.duplicates == 1
    assert window.skipped == {"completions route": 1, "empty completion": 1, "no prompt tokens": 1}
    ordered = [c.id for c in window.used]
    assert ordered == ["traffic-r0", "traffic-r1", "traffic-r2", "traffic-r4", "traffic-r5", "traffic-r6", "traffic-r7",
                       "traffic-r8", "traffic-r9", "traffic-r90"]
    assert [c.id for c in window.held_out] == ["traffic-r8", "traffic-r9", "traffic-r90"]  # the newest 30%
    assert max(c.time_s for c in window.train) < min(c.time_s for c in window.held_out)
    assert window.held_out[-1].messages[-1] == {"role": "assistant", "content": "newer answer"}
    assert window.held_out[1].as_bench_sample() == {
        "id": "traffic-r9", "input_ids": [1, 2, 12], "loss_mask": [0, 0, 0], "segment": "code",
        "messages": [{"role": "user", "content": "p9"}]}  # the prompt as served, under the client's segment
    assert "segment" not in window.held_out[0].as_bench_sample()
    prompts = [c.messages[:-1] for c in window.used]
    assert len(prompts) == len({str(p) for p in prompts}), "a prompt both trained on and held out"

    tags = window.provenance()
    assert tags["refresh.traffic_from_s"] == "100.000" and tags["refresh.traffic_to_s"] == "200.000"
    assert tags["refresh.held_out_from_s"] == "108.000"
    assert tags["refresh.traffic_train_requests"] == "7" and tags["refresh.traffic_held_out_requests"] == "3"
    assert tags["refresh.traffic_segments"] == "code"


def test_max_records_keeps_the_newest_window(tmp_path):
    records = [_chat(i, float(i), f"p{i}") for i in range(12)]
    window = traffic_window(_stored(tmp_path, records), RefreshConfig(min_records=5, max_records=6, held_out_fraction=0.5))
    assert [c.id for c in window.train] == ["traffic-r6", "traffic-r7", "traffic-r8"]
    assert [c.id for c in window.held_out] == ["traffic-r9", "traffic-r10", "traffic-r11"]


def test_replay_picks_the_same_seeded_share_of_the_original_conversations():
    originals = [{"id": f"o{i}", "messages": []} for i in range(20)]
    first = replay_sample(originals, 5, seed=0)
    assert len(first) == 5 and first == replay_sample(list(reversed(originals)), 5, seed=0)
    assert [c["id"] for c in first] != [c["id"] for c in replay_sample(originals, 5, seed=1)]
    assert len(replay_sample(originals, 50, seed=0)) == 20


def test_too_little_traffic_stops_the_refresh_in_one_line_naming_the_store_and_the_fix(tmp_path, capsys):
    """Before any champion is looked up or anything trains: a store of 3 distinct chat requests (4 records, one
    prompt repeated) against refresh.min_records=20."""
    _stored(tmp_path, [_chat(0, 1.0, "a"), _chat(1, 2.0, "b"), _chat(2, 3.0, "a"), _chat(3, 4.0, "c")])
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", [f"data_dir={tmp_path / 'data'}",
                                                          f"serve.traffic.dir={tmp_path / 'traffic'}"])
    with pytest.raises(RefreshError, match=r"holds 3 distinct chat request\(s\) \(4 record\(s\) read, 1 repeated.*"
                                           r"refresh.min_records is 20: capture more traffic"):
        load_window(cfg)
    assert main(["refresh", "-c", str(REPO / "configs" / "tiny-cpu.yaml"), f"data_dir={tmp_path / 'data'}",
                 f"serve.traffic.dir={tmp_path / 'traffic'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0]


def test_the_ray_job_entry_point_dry_run_shows_the_window_and_writes_nothing(tmp_path):
    """jobs/refresh.py (what `ray job submit` runs) with --dry-run: the window's split by time, nothing trained."""
    _stored(tmp_path, [_chat(i, 1_800_000_000.0 + 60 * i, f"p{i}", segment="team-a") for i in range(10)])
    data_dir = tmp_path / "data"
    done = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "refresh.py"), "--config", str(REPO / "configs" / "tiny-cpu.yaml"),
         "--dry-run", f"data_dir={data_dir}", f"serve.traffic.dir={tmp_path / 'traffic'}", "refresh.min_records=10"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "10 record(s) read, 0 repeated prompt(s)" in done.stdout
    assert "train on 8 request(s) finished 2027-01-15T08:00:00Z .. 2027-01-15T08:07:00Z" in done.stdout
    assert "hold out 2 request(s) finished 2027-01-15T08:08:00Z .. 2027-01-15T08:09:00Z" in done.stdout
    assert "client segments: team-a" in done.stdout
    assert not (data_dir / "refresh").exists()
