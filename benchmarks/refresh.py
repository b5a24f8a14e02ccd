"""One refresh, measured live: a champion trained on one prompt distribution serves another; does the loop fix it?

    PYTHONPATH=platform .venv/bin/python benchmarks/refresh.py [--traffic 80] [--measure 24] [--train-steps 60]
        [--via-drift]

One local Ray and one Serve app (the test-size target, the reference engine) with traffic capture on. The champion
is the tests' fitted `quick_drafter`, trained on the test dataset: questions "What does `X` in M do?". A client
then replays a different prompt set through the endpoint (instructions: "List ...", "Translate ...", ...), to which
the target answers differently. Then `refresh` runs in this process as `draftline refresh` does: the real window,
Ray Train + DeepSpeed from the champion's weights, both real gates, and `promote_and_roll` of the running app.
With --via-drift the champion is gated first (the real gate, for the accept length the drift check compares with),
the app runs with serve.drift.refresh, and the refresh is the Ray job the drift check submits when the replayed
traffic pulls the live accept length down; the script waits for that job.

Live accept length (the `usage.spec_accept_length` the endpoint answers with, mean over requests) is measured
before and after, through the endpoint, on two sets nobody trains on: `--measure` prompts of the new distribution
that are not among the replayed ones, and the original dataset's bench split. Their requests carry segment tags
that the benchmark's redaction hook (`serve.traffic.redact`, benchmarks/refresh_redact.py) keeps out of the store.
A background client keeps sending requests of the new distribution while the refresh trains, gates and rolls;
every request of the run is counted, and the report says how many failed.

Goal (issue "Learn from the traffic you serve"): the new distribution's accept length up by at least 20%, the
original set's down by at most 2%, zero failed requests. Results in benchmarks/refresh.json and RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import ray
from ray.job_submission import JobSubmissionClient

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from conftest import FITTED_DRAFTER_STEPS, SMALL_BENCH, free_port, make_test_config  # noqa: E402

from draftline.bench.quick_drafter import quick_drafter  # noqa: E402
from draftline.data.prepare import load_split, prepare  # noqa: E402
from draftline.drafter.export import load_drafter  # noqa: E402
from draftline.gate import run_gate  # noqa: E402
from draftline.raycluster import ensure_ray  # noqa: E402
from draftline.refresh.run import refresh  # noqa: E402
from draftline.registry import CHAMPION, alias_version_number, promote  # noqa: E402
from draftline.serving.control import serve_champion  # noqa: E402
from draftline.serving.traffic_store import read_records, traffic_dir  # noqa: E402
from draftline.target.bootstrap import bootstrap_target  # noqa: E402
from draftline.tracking import GATE_TAG, REFRESH_JOB_TAG, mlflow_client  # noqa: E402
from refresh_redact import MEASURE_PREFIX  # noqa: E402
from registry_helpers import mlflow_overrides, register_drafter  # noqa: E402

SEGMENT_HEADER = "x-draftline-segment"
NEW_SEGMENT = "instructions"  # the replayed traffic, captured
MAX_TOKENS = 24
# --via-drift: the drift window spans the measurement requests and most of the replayed ones, so the drift fires
# once the store holds enough traffic to refresh on.
DRIFT_WINDOW_REQUESTS = 100

THINGS = ["colors", "fruits", "animals", "cities", "rivers", "tools", "metals", "planets", "trees", "birds",
          "songs", "games", "sports", "drinks", "flowers", "islands"]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Dutch"]
PHRASES = ["good morning", "thank you", "see you soon", "where is the station", "I like tea", "it is raining"]


def instruction_prompts() -> list[str]:
    """The second distribution: short instructions, in a fixed order (distinct prompts)."""
    lists = [f"{verb} {n} {thing}." for verb, n, thing in itertools.product(
        ("List", "Name", "Give me"), ("two", "three", "four", "five"), THINGS)]
    translations = [f"Translate to {lang}: {phrase}" for lang, phrase in itertools.product(LANGUAGES, PHRASES)]
    mixed = [p for pair in itertools.zip_longest(lists, translations) for p in pair if p]
    return mixed


def config(tmp: Path, args):
    # The gate as cheap as the refresh tests' (2 paired rounds of the small bench, concurrency 1; speed relaxed: a
    # shared 2-core machine's wall clock is not what this measures), training on one worker.
    store = tmp / "traffic"
    return make_test_config(extra=mlflow_overrides(tmp) + SMALL_BENCH + [
        f"serve.port={free_port()}", "serve.max_tokens_limit=32", "serve.ingress_replicas=1",
        "serve.traffic.enabled=true", f"serve.traffic.dir={store}",
        "serve.traffic.redact=refresh_redact:unmeasured_only",
        "bench.concurrency=[1]", "gate.min_rounds=2", "gate.max_rounds=2",
        "gate.min_speedup=0.01", "gate.min_accept_len=1.0", "gate.max_p99_latency_ratio=100",
        f"train.storage_uri={tmp / 'ray-train'}", "train.num_workers=1", "train.micro_batch_size=8",
        f"train.val_every={args.train_steps}", f"train.checkpoint_every={args.train_steps}",
        f"refresh.min_records={min(20, args.traffic)}", "refresh.held_out_fraction=0.2",
        f"refresh.train_steps={args.train_steps}", "refresh.replay_ratio=1.0",
        *([f"serve.drift.window_requests={DRIFT_WINDOW_REQUESTS}", "serve.drift.refresh=true"] if args.via_drift
          else ["serve.drift.enabled=false"]),
    ])


def champion(cfg, gated: bool) -> str:
    """The tests' fitted drafter (built with the tests' own config, so found in their cache), registered, gated
    for real (`gated`, the drift check reads the gate's accept length) or tagged gate=passed, and promoted."""
    tests_cfg = make_test_config()
    target_dir = bootstrap_target(tests_cfg)
    dataset_dir = prepare(tests_cfg, target_dir)
    drafter_dir = quick_drafter(tests_cfg, target_dir, dataset_dir, steps=FITTED_DRAFTER_STEPS)
    version = register_drafter(cfg, load_drafter(drafter_dir))
    if gated:
        decision = run_gate(cfg, version, dataset_dir=dataset_dir)
        assert decision.passed, f"the champion's gate: {decision.reasons}"
    else:
        mlflow_client(cfg).set_model_version_tag(cfg.registered_model_name, version, GATE_TAG, "passed")
    promote(cfg, version)
    return version


def refresh_in_process(cfg) -> dict:
    record = refresh(cfg)
    return {"version": record.version, "promoted": record.promoted, "traffic_gate": record.traffic_gate,
            "bench_gate": record.bench_gate, "reasons": record.reasons}


def refresh_by_drift(cfg, version: str, job_log: Path, timeout_s: float = 1500) -> dict:
    """Wait for the Ray job the drift check submitted for `version` (serve.drift.refresh) to end; its log goes to
    `job_log`."""
    registry = mlflow_client(cfg)
    deadline = time.monotonic() + 120
    while not (job_id := registry.get_model_version(cfg.registered_model_name, version).tags.get(REFRESH_JOB_TAG)):
        assert time.monotonic() < deadline, f"no {REFRESH_JOB_TAG} tag on version {version} after 120 s: no drift?"
        time.sleep(2)
    jobs = JobSubmissionClient(ray.get_runtime_context().gcs_address)
    deadline = time.monotonic() + timeout_s
    while not (status := jobs.get_job_status(job_id)).is_terminal():
        assert time.monotonic() < deadline, f"Ray job {job_id} still {status} after {timeout_s} s"
        time.sleep(5)
    logs = jobs.get_job_logs(job_id)
    job_log.write_text(logs)
    summary = [line for line in logs.splitlines() if line.startswith(("refresh: version", "[refresh] gate on"))]
    return {"job": job_id, "status": str(status), "summary": summary or logs[-2000:],
            "champion_after": alias_version_number(cfg, CHAMPION)}


async def send(url: str, prompts: list, segment: str, concurrency: int = 2) -> list[dict]:
    """Each prompt (a string, or a list of messages) once; the answers' usage and version, or the failure."""
    gate = asyncio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient, prompt) -> dict:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        async with gate:
            try:
                response = await http.post(f"{url}/v1/chat/completions", headers={SEGMENT_HEADER: segment},
                                           json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
            except httpx.HTTPError as err:
                return {"failed": repr(err)}
        if response.status_code != 200:
            return {"failed": f"HTTP {response.status_code}: {response.text[:200]}"}
        body = response.json()
        return {"accept_length": body["usage"]["spec_accept_length"], "version": body["draftline"]["model_version"]}

    async with httpx.AsyncClient(timeout=300) as http:
        return await asyncio.gather(*(one(http, p) for p in prompts))


def accept_length(results: list[dict]) -> float:
    values = [r["accept_length"] for r in results if "accept_length" in r]
    return round(sum(values) / len(values), 4) if values else float("nan")


class BackgroundClient:
    """One client sending the new distribution's prompts, one at a time, until stopped: failures during the refresh
    and the rollout, and which versions answered."""

    def __init__(self, url: str, prompts: list[str]) -> None:
        self.url, self.prompts = url, prompts
        self.results: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for prompt in itertools.cycle(self.prompts):
            if self._stop.is_set():
                return
            self.results += asyncio.run(send(self.url, [prompt], NEW_SEGMENT, concurrency=1))
            self._stop.wait(1.0)

    def __enter__(self) -> "BackgroundClient":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traffic", type=int, default=80, help="distinct prompts of the new distribution replayed")
    parser.add_argument("--measure", type=int, default=24, help="prompts of each measured set")
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--via-drift", action="store_true",
                        help="the refresh is the Ray job the drift check starts (serve.drift.refresh)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "refresh.json"))
    args = parser.parse_args()
    started = time.monotonic()
    # The capture replica imports the redaction hook from benchmarks/: the local cluster's workers get this path.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    ensure_ray(num_cpus=6)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cfg = config(tmp, args)
        version_before = champion(cfg, gated=args.via_drift)
        url = serve_champion(cfg)
        prompts = instruction_prompts()
        traffic, measure_new = prompts[:args.traffic], prompts[args.traffic:args.traffic + args.measure]
        assert len(measure_new) == args.measure, f"only {len(prompts)} prompts of the new distribution"
        original = [s["messages"][:1] for s in load_split(prepare(cfg, bootstrap_target(cfg)), "bench")][:args.measure]

        before = {"new": asyncio.run(send(url, measure_new, MEASURE_PREFIX + "new")),
                  "original": asyncio.run(send(url, original, MEASURE_PREFIX + "original"))}
        replayed = asyncio.run(send(url, traffic, NEW_SEGMENT))
        time.sleep(1)  # the capture actor's last batch (0.2 s)
        stored = sum(1 for _ in read_records(traffic_dir(cfg)))
        load_before = psutil.getloadavg()
        print(f"before: new {accept_length(before['new'])}, original {accept_length(before['original'])}, replayed "
              f"{accept_length(replayed)}; {stored} records stored; load {load_before}", flush=True)

        refresh_started = time.monotonic()
        with BackgroundClient(url, traffic) as background:
            if args.via_drift:
                done = refresh_by_drift(cfg, version_before, Path(args.out).with_suffix(".job.log"))
            else:
                done = refresh_in_process(cfg)
        refresh_s = time.monotonic() - refresh_started
        load_after = psutil.getloadavg()
        after = {"new": asyncio.run(send(url, measure_new, MEASURE_PREFIX + "new")),
                 "original": asyncio.run(send(url, original, MEASURE_PREFIX + "original"))}

    every = [*before["new"], *before["original"], *replayed, *background.results, *after["new"], *after["original"]]
    failed = [r["failed"] for r in every if "failed" in r]
    result = {
        "accept_length": {side: {name: accept_length(rs) for name, rs in sets.items()}
                          for side, sets in (("before", before), ("after", after))},
        "versions": {"before": version_before, "after": sorted({r["version"] for r in after["new"] if "version" in r})},
        "refresh": {**done, "seconds": round(refresh_s, 1)},
        "requests": {"total": len(every), "failed": len(failed), "failures": failed[:5],
                     "background_during_refresh": len(background.results),
                     "background_versions": sorted({r["version"] for r in background.results if "version" in r})},
        "replayed_accept_length": accept_length(replayed), "records_stored": stored,
        "args": vars(args), "load_avg": {"before_refresh": load_before, "after_refresh": load_after},
        "wall_s": round(time.monotonic() - started, 1),
    }
    a = result["accept_length"]
    result["change"] = {name: round(a["after"][name] / a["before"][name] - 1, 4) for name in ("new", "original")}
    result["goal_met"] = (result["change"]["new"] >= 0.20 and result["change"]["original"] >= -0.02
                          and not failed)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
