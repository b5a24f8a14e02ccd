"""What traffic capture costs a request: two Serve apps side by side, capture on and off, paired rounds.

    PYTHONPATH=platform .venv/bin/python benchmarks/traffic.py [--rounds 6] [--requests 24] [--concurrency 4]

One local Ray and one Serve instance run one engine app (the test-size target, the reference engine, the tests'
fitted `quick_drafter`) and two ingress apps in front of it, `/on` with serve.traffic.enabled (every request sampled)
and `/off` without, one ingress replica each: the two sides share the engine replica. Each round sends the same chat requests to both, in alternating order (ABBA), so a
burst of machine load lands on both sides of a pair. Per side and round: the p50 client latency, and the CPU time of
the app's ingress replica, and of the capture replica apart (psutil, every thread). The report gives the ratios
on/off of p50 latency and of ingress CPU time per request, each with a 95% bootstrap interval over rounds, and checks that
every request of `/on` was recorded. Results in benchmarks/traffic.json and benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from conftest import free_port, make_test_config  # noqa: E402 - the tests' target, dataset and fitted drafter

from draftline.bench.quick_drafter import quick_drafter  # noqa: E402
from draftline.data.prepare import prepare  # noqa: E402
from draftline.raycluster import ensure_ray  # noqa: E402
from draftline.serving.app import ENGINE_APPS, build_app, build_engine_app  # noqa: E402
from draftline.serving.control import start_serve  # noqa: E402
from draftline.serving.served_model import ServedModel  # noqa: E402
from draftline.serving.traffic_store import read_records, traffic_dir  # noqa: E402
from draftline.target.bootstrap import bootstrap_target  # noqa: E402

SIDES = ("on", "off")


def deploy(store: Path) -> tuple[str, dict]:
    """Both apps; returns (base URL, {side: config})."""
    from ray import serve

    # blue_green: each ingress app sends requests to the engine app its user_config names, so both sides share one
    # engine replica and differ only in their ingress (and capture) replicas.
    base = [f"serve.port={free_port()}", "serve.ingress_replicas=1", "serve.max_tokens_limit=16",
            "serve.rollout=blue_green"]
    configs = {"on": make_test_config(extra=base + ["serve.traffic.enabled=true", f"serve.traffic.dir={store}"]),
               "off": make_test_config(extra=base)}
    cfg = configs["on"]
    target_dir = bootstrap_target(cfg)
    drafter_dir = quick_drafter(cfg, target_dir, prepare(cfg, target_dir), steps=200)
    served = ServedModel(registered_model=cfg.registered_model_name, model_version="1", export_dir=str(drafter_dir))
    start_serve(cfg)
    serve.run(build_engine_app(configs["off"], served), name=ENGINE_APPS[0], route_prefix=None)
    for side, side_cfg in configs.items():
        serve.run(build_app(side_cfg, served, auth_token_sha256=None, engine_app=ENGINE_APPS[0]), name=f"traffic-{side}",
                  route_prefix=f"/{side}")
    return f"http://{cfg.serve.host}:{cfg.serve.port}", configs


def replica_processes(side: str, deployment: str) -> list[psutil.Process]:
    """The side's replicas of `deployment`, by the process title Ray gives an actor (ray::<class name>)."""
    title = f"ray::ServeReplica:traffic-{side}:{deployment}"
    return [p for p in psutil.process_iter(["cmdline"]) if title in " ".join(p.info["cmdline"] or [])]


def cpu_s(processes: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)


async def one_side(url: str, side: str, prompts: list[str], concurrency: int) -> tuple[list[float], list[str]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient, prompt: str) -> tuple[float, str]:
        async with gate:
            started = time.perf_counter()
            response = await http.post(f"{url}/{side}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0})
            response.raise_for_status()
            return time.perf_counter() - started, response.json()["id"]

    async with httpx.AsyncClient(timeout=300) as http:
        done = await asyncio.gather(*(one(http, p) for p in prompts))
    return [latency for latency, _ in done], [request_id for _, request_id in done]


def interval(on: np.ndarray, off: np.ndarray, samples: int = 4000, seed: int = 0) -> list[float]:
    """Ratio of sums on/off with a 95% percentile bootstrap over rounds (paired: a round's two sides together)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(on), size=(samples, len(on)))
    ratios = on[picks].sum(axis=1) / off[picks].sum(axis=1)
    return [round(float(on.sum() / off.sum()), 4), round(float(np.percentile(ratios, 2.5)), 4),
            round(float(np.percentile(ratios, 97.5)), 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=24, help="requests per side and round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "traffic.json"))
    args = parser.parse_args()
    ensure_ray(num_cpus=4)
    with tempfile.TemporaryDirectory() as tmp:
        url, configs = deploy(Path(tmp) / "traffic")
        prompts = [f"Question {i}: which Python builtin sorts a list?" for i in range(args.requests)]
        asyncio.run(one_side(url, "on", prompts[:4], 2))  # warm both sides up
        asyncio.run(one_side(url, "off", prompts[:4], 2))
        processes = {side: replica_processes(side, "DraftlineIngress") for side in SIDES}
        capture = replica_processes("on", "DraftlineTraffic")
        assert processes["on"] and processes["off"] and capture, "replica processes not found by their titles"
        p50 = {side: [] for side in SIDES}
        cpu_per_request = {side: [] for side in SIDES}
        capture_cpu_per_request = []
        recorded_ids: list[str] = []
        load = []
        for round_index in range(args.rounds):
            order = SIDES if round_index % 2 == 0 else SIDES[::-1]
            for side in order:
                before, capture_before = cpu_s(processes[side]), cpu_s(capture)
                latencies, ids = asyncio.run(one_side(url, side, prompts, args.concurrency))
                time.sleep(0.5)  # the capture batch of the last requests is written (FLUSH_INTERVAL_S 0.2 s)
                cpu_per_request[side].append((cpu_s(processes[side]) - before) / len(ids))
                if side == "on":
                    capture_cpu_per_request.append((cpu_s(capture) - capture_before) / len(ids))
                p50[side].append(float(np.median(latencies)))
                if side == "on":
                    recorded_ids += ids
            load.append(psutil.getloadavg()[0])
            print(f"round {round_index + 1}: p50 on {p50['on'][-1] * 1000:.1f} ms, off {p50['off'][-1] * 1000:.1f} ms; "
                  f"ingress CPU per request on {cpu_per_request['on'][-1] * 1000:.2f} ms, "
                  f"off {cpu_per_request['off'][-1] * 1000:.2f} ms, capture replica "
                  f"{capture_cpu_per_request[-1] * 1000:.2f} ms; load {load[-1]:.1f}", flush=True)
        time.sleep(2)
        stored = {r["id"] for r in read_records(traffic_dir(configs["on"]))}
    report = {
        "rounds": args.rounds, "requests_per_round": args.requests, "concurrency": args.concurrency,
        "p50_latency_s": p50, "ingress_cpu_s_per_request": cpu_per_request,
        "capture_replica_cpu_s_per_request": capture_cpu_per_request,
        "p50_ratio_on_off": interval(np.array(p50["on"]), np.array(p50["off"])),
        "ingress_cpu_ratio_on_off": interval(np.array(cpu_per_request["on"]), np.array(cpu_per_request["off"])),
        "requests_on": len(recorded_ids), "recorded_on": len(stored & set(recorded_ids)),
        "load_1min": [round(x, 1) for x in load],
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("p50_ratio_on_off", "ingress_cpu_ratio_on_off", "requests_on", "recorded_on",
                                             "load_1min")}))


if __name__ == "__main__":
    main()
