"""The extraction workers' job record (extract/job.py) survives the pickling Ray Train gives train_loop_config, and
a worker started without one says how to start it. No Ray: the split tokens' ObjectRef is stood in for by a string."""

from __future__ import annotations

import pickle

import pytest

from conftest import make_test_config
from draftline.extract.job import ExtractionJob, SplitAssignment
from draftline.faults import Fault


def test_an_extraction_job_round_trips_through_the_loop_config(tmp_path):
    job = ExtractionJob(
        cfg=make_test_config(tmp_path, ["extract.samples_per_shard=7"]),
        plan={"target_dir": "/t", "aux_layer_ids": [1, 3], "samples_per_shard": 7, "shard_metadata": {}},
        splits=[SplitAssignment("train", "/h/train", "ref-train"), SplitAssignment("val", "/h/val", "ref-val")],
        fault=Fault("extract.shards", 2, str(tmp_path / "marker")),
    )
    back = ExtractionJob.from_loop_config(pickle.loads(pickle.dumps(job.to_loop_config())))
    assert back.cfg.extract.samples_per_shard == 7 and back.plan == job.plan
    assert [(s.split, s.location, s.split_tokens_ref) for s in back.splits] == [
        ("train", "/h/train", "ref-train"), ("val", "/h/val", "ref-val")]
    assert back.fault.count == 2 and back.storage_full_sink is None


def test_a_worker_given_the_old_dict_says_how_to_start_it():
    with pytest.raises(TypeError, match=r"not the ExtractionJob under 'extraction_job'.*ExtractionJob.to_loop_config"):
        ExtractionJob.from_loop_config({"config": {}, "plan": {}, "splits": []})
