"""Each pipeline stage's output is a typed record (draftline.records) that writes exactly the dict the stage wrote
as a plain dict before, reads such a dict back unchanged, and names the stage, the field and the file when a record
does not match. The old dicts below are copied from stage records written by the code before the typed records
(kept under .draftline-test/pipeline/*/stages/, trimmed) or, for the gate, printed by that code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_test_config
from draftline.extract.run import ExtractRecord, ExtractResult, SplitResult
from draftline.gate import Check, GateDecision, GateRecord
from draftline.pipeline import STAGES, Context, read_stage_outputs, stage_key, write_stage_record
from draftline.records import RecordError
from draftline.regenerate.run import RegenerateResult
from draftline.serving.liveness import ServeRecord
from draftline.utils import read_json, stable_hash

OLD_OUTPUTS = {
    "bootstrap": {"build_seconds": 142.6, "conversation_splits": {"bench": 19, "train": 161, "val": 20},
                  "corpus_hash": "8869000ee9da68ec", "corpus_pairs": 6962, "heldout_perplexity": 50.6817700151207,
                  "num_conversations": 200, "num_parameters": 1279584, "target_dir": "/data/targets/tiny-llama-3ce6",
                  "train_tokens": 311075, "uniform_perplexity": 2048, "unigram_perplexity": 371.57752899406563},
    "regenerate": {"dataset_dir": "/data/regenerated/ab12", "conversations": "/data/regenerated/ab12/conversations.jsonl",
                   "samples": 40, "output_tokens": 5120, "shards_total": 2, "shards_generated": 1, "replica_deaths": 0,
                   "bad_input": 1},
    "prepare": {"dataset_dir": "/data/datasets/9fe8c2ee0b452e76", "report": {"bench": 19, "train": 161, "val": 20}},
    "extract": {"hidden_dir": "/data/hidden/4380e2a223abb53b", "splits": {
        "train": {"bytes_per_token": 1545.8622121555304, "target_fingerprint": "f54fd9650119d132", "total_samples": 161,
                  "total_tokens": 5298},
        "val": {"bytes_per_token": 1546.5739837398373, "target_fingerprint": "f54fd9650119d132", "total_samples": 20,
                "total_tokens": 615}}},
    "train": {"best_step": 20, "cached": False, "export_dir": "/data/drafters/d1b34ba04aca609a/drafter",
              "metrics": {"val_acc_0": 0.775, "val_est_accept_len": 2.6569312210083003, "val_loss": 15.080129384994507},
              "model_version": "1", "run_id": "57e30afee4944212a31ba6c627783561",
              "tags": {"aux_layer_ids": "[1, 3, 4]", "best_step": "20"}, "training_hash": "d1b34ba04aca609a",
              "wall_s": 61.3},
    "gate": {"bench": {"accept_length": 3.5, "baseline_tokens_per_s": 100.5, "concurrency": 1, "cpu_speedup": 1.4,
                       "itl_p50_ms": 4.25, "itl_p99_ms": 12, "lossless": True, "per_request_accept_lengths": [3.0, 4.0],
                       "rows": [{"accept_length": None, "concurrency": 1, "label": "target-only", "lossless": None,
                                 "output_tokens_per_s": 100.5, "speedup_ci": None},
                                {"accept_length": 3.5, "concurrency": 1, "label": "v3", "lossless": True,
                                 "output_tokens_per_s": 150.25, "speedup_ci": [1.25, 1.75]}],
                       "speedup": 1.5, "speedup_ci": [1.25, 1.75], "tokens_per_s": 150.25, "ttft_p50_ms": 9.5},
             "champion_version": None, "checks": {"lossless": False, "speedup": True},
             "intervals": {"speedup": [1.25, 1.75]}, "machine_load": {"cores": 2, "load_avg_1m": [2.5, 3.0]},
             "passed": False, "reasons": ["v3 output differs from the target's"], "rounds": 2, "run_id": "abc",
             "verdict": "failed", "version": "3"},
    "promote": {"promoted": False, "version": "1"},
    "serve": {"completion": "Return the list of the list.", "local_cluster": True, "ray_address": "127.0.0.1:37387",
              "ray_session": "session_2026-12-06_14-38-41_062311_22551", "url": "http://127.0.0.1:42207",
              "version": "target-only"},
}
ONLINE_EXTRACT = {"hidden_dir": None, "mode": "online", "streamed_bytes_per_token": 1536, "aux_layer_ids": [1, 3, 4]}
# A serve record from before the serve stage recorded its Ray cluster.
OLD_SERVE = {"url": "http://127.0.0.1:8000", "version": "2", "completion": "ok"}

STAGE = {stage.name: stage for stage in STAGES}


def test_every_stage_has_its_own_record_type():
    assert sorted(OLD_OUTPUTS) == sorted(STAGE)
    for stage in STAGES:
        assert stage.record.STAGE == stage.name


@pytest.mark.parametrize("name, outputs", [*OLD_OUTPUTS.items(), ("extract", ONLINE_EXTRACT), ("serve", OLD_SERVE)])
def test_an_old_record_reads_back_to_exactly_the_dict_it_was(name, outputs):
    record = STAGE[name].record.from_dict(json.loads(json.dumps(outputs)), "stages/x.json")
    assert isinstance(record, STAGE[name].record)
    assert record.to_dict() == outputs
    assert json.dumps(record.to_dict(), sort_keys=True) == json.dumps(outputs, sort_keys=True)


def test_records_made_by_the_stages_write_the_old_dicts(tmp_path):
    regenerated = RegenerateResult(out_dir=Path("/data/regenerated/ab12"), conversations=40, output_tokens=5120,
                                   shards_total=2, shards_generated=1, replica_deaths=0, bad_input=1, seconds=9.5)
    assert regenerated.to_record().to_dict() == OLD_OUTPUTS["regenerate"]

    manifest = {"total_samples": 161, "total_tokens": 5298, "bytes_per_token": 1545.8622121555304,
                "target_fingerprint": "f54fd9650119d132", "total_bytes": 8190000, "last_run": {}}
    result = ExtractResult(location=Path("/data/hidden/4380e2a223abb53b"), splits={
        "train": SplitResult("train", "/data/hidden/4380e2a223abb53b/train", manifest, cached=True),
        "val": SplitResult("val", "/data/hidden/4380e2a223abb53b/val",
                           {"total_samples": 20, "total_tokens": 615, "bytes_per_token": 1546.5739837398373,
                            "target_fingerprint": "f54fd9650119d132"}, cached=False)})
    assert ExtractRecord.offline(result).to_dict() == OLD_OUTPUTS["extract"]
    assert ExtractRecord.online(1536, [1, 3, 4]).to_dict() == ONLINE_EXTRACT

    def row(label, accept, tokens_per_s):
        return {"label": label, "concurrency": 1, "accept_length": accept, "lossless": True if accept else None,
                "output_tokens_per_s": tokens_per_s, "speedup_ci": [1.25, 1.75] if accept else None,
                "speedup": 1.5, "cpu_speedup": 1.4, "ttft_ms_p50": 9.5, "itl_ms_p50": 4.25, "itl_ms_p99": 12,
                "per_request_accept_lengths": [3.0, 4.0] if accept else []}

    decision = GateDecision(
        version="3", passed=False, rounds=2, run_id="abc",
        checks=[Check("speedup", "pass", "ok", [1.25, 1.75]), Check("lossless", "fail", "v3 output differs from the target's")],
        bench={"rows": [row("target-only", None, 100.5), row("v3", 3.5, 150.25)],
               "machine_load": {"cores": 2, "load_avg_1m": [2.5, 3.0]}},
    )
    written = decision.to_record().to_dict()
    expected = OLD_OUTPUTS["gate"]
    assert {k: v for k, v in written.items() if k != "bench"} == {k: v for k, v in expected.items() if k != "bench"}
    assert {k: v for k, v in written["bench"].items() if k != "rows"} == \
        {k: v for k, v in expected["bench"].items() if k != "rows"}


def test_a_stage_key_hashes_the_upstream_record_as_the_old_dict(tmp_path):
    cfg = make_test_config(tmp_path)
    extract = STAGE["extract"]
    outputs = {"prepare": STAGE["prepare"].record.from_dict(OLD_OUTPUTS["prepare"], "prepare.json")}
    dumped = cfg.model_dump(mode="json")
    old_key = stable_hash({s: dumped[s] for s in extract.sections}, {"prepare": OLD_OUTPUTS["prepare"]})[:16]
    assert stage_key(cfg, extract, outputs) == old_key


def test_a_stage_record_file_round_trips_and_the_context_hands_out_typed_records(tmp_path):
    path = tmp_path / "stages" / "serve.json"
    record = ServeRecord.from_dict(OLD_OUTPUTS["serve"], path)
    write_stage_record(path, "k1", record, seconds=1.5)
    on_disk = read_json(path)
    assert on_disk["outputs"] == OLD_OUTPUTS["serve"] and on_disk["key"] == "k1"
    assert read_stage_outputs(STAGE["serve"], on_disk, "k1", path) == record
    assert read_stage_outputs(STAGE["serve"], on_disk, "another key", path) is None
    ctx = Context(cfg=make_test_config(tmp_path), outputs={"serve": record})
    assert ctx.record(ServeRecord).url == "http://127.0.0.1:42207"


@pytest.mark.parametrize("stage, outputs, field, problem", [
    ("prepare", {"report": {"train": 1}}, "outputs.dataset_dir", "is missing"),
    ("prepare", {**OLD_OUTPUTS["prepare"], "report": {"train": "161"}}, "outputs.report.train", "expected int"),
    ("gate", {**OLD_OUTPUTS["gate"], "passed": "yes"}, "outputs.passed", "expected bool"),
    ("gate", {**OLD_OUTPUTS["gate"], "bench": {**OLD_OUTPUTS["gate"]["bench"], "speedup": None, "rows": 3}},
     "outputs.bench.rows", "expected list"),
    ("train", {k: v for k, v in OLD_OUTPUTS["train"].items() if k != "run_id"}, "outputs.run_id", "is missing"),
    ("promote", {**OLD_OUTPUTS["promote"], "promted": True}, "outputs", "unknown field(s) ['promted']"),
    ("bootstrap", {"num_parameters": 5}, "outputs.target_dir", "is missing"),
    ("extract", {**OLD_OUTPUTS["extract"], "splits": {"train": {"total_samples": 1}}}, "outputs.splits.train.total_tokens",
     "is missing"),
    ("serve", [], "outputs", "is list"),
])
def test_a_record_that_does_not_match_names_the_stage_the_field_and_the_file(tmp_path, stage, outputs, field, problem):
    path = tmp_path / "stages" / f"{stage}.json"
    with pytest.raises(RecordError) as raised:
        read_stage_outputs(STAGE[stage], {"key": "k", "outputs": outputs}, "k", path)
    message = str(raised.value)
    assert message.startswith(f"{stage} stage record {path}: {field} ")
    assert problem in message
    assert f"--from {stage}" in message
