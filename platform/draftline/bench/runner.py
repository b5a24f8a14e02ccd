"""Load generation and metrics for any `Engine`: the same prompts through every engine, in one run.

Metrics (SGLang bench_serving's definitions):
  output_tokens_per_s  all output tokens / wall time of the load at that concurrency
  ttft_ms              submit -> first streamed token, per request
  itl_ms               gaps between streamed chunks (a speculative chunk can hold several tokens)
  tpot_ms              (latency - ttft) / (output tokens - 1), per request
  decode_tokens_per_s  tokens after the first / time after the first token, over all requests (the decode
                       phase speculation speeds up; output_tokens_per_s also holds every prefill)
  accept_length        output tokens / verify steps over all requests (bonus token included); for an engine that
                       counts server-side only (vLLM: `spec_counters()`), output tokens / its verify count (drafts)
                       over the load; its raw counters, own mean acceptance length (1 + accepted / drafts) and
                       per-position acceptance are in `engine_counters`
  accept_length_by_segment  the same per prompt segment (has-tools, thinking-on, thinking-off, plain;
                       bench/prompts.py segment_of; or a bench sample's own, sample_segment), with its prompt count: a drafter trained on one mode is
                       measured on each. Server-side counters are per load, so for vLLM this is from the streamed
                       per-request stats only (None where an engine gives none)
  speedup              tokens/s against the target-only engine at the same concurrency, over all rounds, as
                       (sum tokens / sum request latency) per side (Little's law: proportional to tokens/s in a
                       closed loop), with a paired bootstrap interval over rounds and prompts (bench/stats.py)
  decode_speedup       decode_tokens_per_s / the target-only engine's
  cpu_speedup          the output_tokens_per_s ratio on CPU time instead of wall time: for in-process engines (the
                       reference engine) this process's CPU time (time.process_time), for server engines (vLLM,
                       SGLang) the CPU time of the server's process tree (`server_cpu_seconds()`: the API server
                       and every engine process in its session); on a shared machine it ignores other processes'
                       load. `cpu_of` says which; `cpu_ms_per_token` is the same figure per output token
  lossless             greedy only: every output, in every round, is token-identical to the target-only engine's
Rows pool every round (bench.rounds); rounds are paired and interleaved (PairedRounds), the order of the engines
alternating from round to round (`round_order` in the report).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from draftline.bench.prompts import SEGMENTS, BenchPrompt
from draftline.bench.stats import Interval, throughput_ratio
from draftline.config import DraftlineConfig, SpeculativeConfig
from draftline.engines import make_engine
from draftline.engines.base import TARGET_ONLY, Engine, SamplingParams, SpecStats


BASELINE = TARGET_ONLY  # the label of the bench row every speedup is relative to


@dataclass
class RequestResult:
    prompt_id: str
    output_ids: list[int]
    ttft_s: float
    chunk_gaps_s: list[float]
    latency_s: float
    stats: SpecStats
    segment: str = "plain"  # the prompt's (bench/prompts.py SEGMENTS)


@dataclass
class EngineSpec:
    """One engine of a bench run: label, drafter export (None = target only), speculative parameters."""

    label: str
    drafter_dir: Optional[Path] = None
    speculative: Optional[SpeculativeConfig] = None
    model_version: Optional[str] = None

    def spec_text(self) -> str:
        if self.drafter_dir is None or self.speculative is None:
            return "-"
        s = self.speculative
        return f"{s.num_steps}/{s.eagle_topk}/{s.num_draft_tokens}"

    def name(self) -> str:
        """The label, and the speculative parameters where there are some: e.g. `v3 3/1/4`."""
        return self.label if self.spec_text() == "-" else f"{self.label} {self.spec_text()}"


@dataclass
class LoadRun:
    """One engine at one concurrency level in one round."""

    requests: list[RequestResult] = field(repr=False)  # in prompt order
    wall_s: float
    cpu_s: float  # CPU seconds of what ran the engine: this process, or the server's process tree (cpu_of)
    load_avg_1m: float  # the machine's 1-minute load average when the run started
    phase_seconds: Optional[dict] = None  # the engine's time per decoding phase during the run, where it counts them
    engine_counters: Optional[Any] = None  # the engine's own speculative counters over the run (vLLM)
    cpu_of: str = "this process"


@dataclass
class LoadRow:
    """One engine at one concurrency level, pooled over the rounds it ran."""

    label: str
    spec: str  # "steps/topk/draft_tokens" or "-"
    concurrency: int
    runs: list[LoadRun] = field(repr=False)
    speedup: Optional[Interval] = None
    cpu_speedup: Optional[float] = None
    decode_speedup: Optional[float] = None
    lossless: Optional[bool] = None

    @property
    def engine_counters(self) -> Optional[Any]:
        """The engine's own speculative counters summed over the rounds (vLLM), None for engines without them."""
        counted = [run.engine_counters for run in self.runs]
        if not counted or any(c is None for c in counted):
            return None
        total = counted[0]
        for more in counted[1:]:
            total = total.plus(more)
        return total

    @property
    def requests(self) -> list[RequestResult]:
        return [r for run in self.runs for r in run.requests]

    def phase_seconds(self, wall_s: float) -> Optional[dict]:
        """Seconds per decoding phase over all rounds (engines that count them), overhead = the rest of wall time."""
        if any(run.phase_seconds is None for run in self.runs):
            return None
        total = {key: round(sum(run.phase_seconds[key] for run in self.runs), 4) for key in self.runs[0].phase_seconds}
        counted = sum(value for key, value in total.items() if key != "steps")
        return {**total, "overhead": round(wall_s - counted, 4)}

    def metrics(self) -> dict:
        requests = self.requests
        wall_s = sum(run.wall_s for run in self.runs)
        cpu_s = sum(run.cpu_s for run in self.runs)
        output_tokens = sum(len(r.output_ids) for r in requests)
        stats = SpecStats()
        for r in requests:
            stats = stats.merge(r.stats)
        gaps = [g for r in requests for g in r.chunk_gaps_s]
        tpots = [(r.latency_s - r.ttft_s) / (len(r.output_ids) - 1) for r in requests if len(r.output_ids) > 1]
        ttfts = [r.ttft_s for r in requests]
        decode_tokens = sum(len(r.output_ids) - 1 for r in requests if r.output_ids)
        decode_s = sum(r.latency_s - r.ttft_s for r in requests if r.output_ids)
        return {
            "label": self.label,
            "spec": self.spec,
            "concurrency": self.concurrency,
            "rounds": len(self.runs),
            "requests": len(self.runs[0].requests),
            "output_tokens": output_tokens,
            "wall_s": round(wall_s, 4),
            "output_tokens_per_s": round(output_tokens / wall_s, 2) if wall_s else 0.0,
            "cpu_of": self.runs[0].cpu_of,
            "cpu_s": round(cpu_s, 3),
            "cpu_ms_per_token": round(1000 * cpu_s / output_tokens, 3) if output_tokens else None,
            "output_tokens_per_cpu_s": round(output_tokens / cpu_s, 2) if cpu_s else 0.0,
            "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s else 0.0,
            "ttft_ms_p50": _ms(percentile(ttfts, 50)),
            "ttft_ms_p99": _ms(percentile(ttfts, 99)),
            "itl_ms_p50": _ms(percentile(gaps, 50)),
            "itl_ms_p99": _ms(percentile(gaps, 99)),
            "tpot_ms_p50": _ms(percentile(tpots, 50)),
            "accept_length": _accept_length(stats, self.engine_counters),
            "engine_counters": self.engine_counters.as_dict() if self.engine_counters is not None else None,
            "speedup": round(self.speedup.estimate, 3) if self.speedup is not None else None,
            "speedup_ci": [round(self.speedup.low, 3), round(self.speedup.high, 3)] if self.speedup is not None else None,
            "cpu_speedup": round(self.cpu_speedup, 3) if self.cpu_speedup is not None else None,
            "decode_speedup": round(self.decode_speedup, 3) if self.decode_speedup is not None else None,
            "lossless": self.lossless,
            "load_avg_1m": [min(run.load_avg_1m for run in self.runs), max(run.load_avg_1m for run in self.runs)],
            "phase_s": self.phase_seconds(wall_s),
            "accept_length_by_segment": accept_length_by_segment(requests),
            "per_request_accept_lengths": [
                round(r.stats.accept_length, 3) for r in self.runs[0].requests if r.stats.verify_steps
            ],
        }


def accept_length_by_segment(requests: list[RequestResult]) -> dict[str, dict]:
    """Per prompt segment present (has-tools, thinking-on, thinking-off, plain, then a sample's own, by name): accept
    length over its requests in every round (output tokens / verify steps, as the whole row's) and how many prompts
    it holds."""
    by_segment: dict[str, dict] = {}
    for segment in [*SEGMENTS, *sorted({r.segment for r in requests} - set(SEGMENTS))]:
        chosen = [r for r in requests if r.segment == segment]
        if not chosen:
            continue
        stats = SpecStats()
        for r in chosen:
            stats = stats.merge(r.stats)
        by_segment[segment] = {"accept_length": round(stats.accept_length, 3) if stats.verify_steps else None,
                               "prompts": len({r.prompt_id for r in chosen})}
    return by_segment


def _accept_length(stats: SpecStats, engine_counters) -> Optional[float]:
    if engine_counters is not None:  # the same definition from the engine's verify count (vLLM: drafts)
        stats = SpecStats(engine_counters.drafts, engine_counters.accepted_tokens, stats.output_tokens)
    return round(stats.accept_length, 3) if stats.verify_steps else None


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(seconds * 1000, 3)


def percentile(values: list[float], pct: float) -> Optional[float]:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def run_request(engine: Engine, prompt: BenchPrompt, params: SamplingParams) -> RequestResult:
    started = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    output: list[int] = []
    stats = SpecStats()
    async for chunk in engine.generate(prompt.input_ids, params):
        now = time.perf_counter()
        if chunk.token_ids:
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
            output.extend(chunk.token_ids)
        if chunk.stats is not None:
            stats = chunk.stats
    finished = time.perf_counter()
    return RequestResult(prompt.id, output, (first or finished) - started, gaps, finished - started, stats, prompt.segment)


async def run_load(engine: Engine, prompts: list[BenchPrompt], concurrency: int, params: SamplingParams) -> LoadRun:
    """All prompts, at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: BenchPrompt) -> RequestResult:
        async with gate:
            return await run_request(engine, prompt, params)

    load_avg_1m = os.getloadavg()[0]
    phases = getattr(engine, "phase_seconds", None)
    before = dict(phases) if phases is not None else None
    server_cpu = getattr(engine, "server_cpu_seconds", None)
    cpu_seconds = server_cpu or time.process_time
    started, started_cpu = time.perf_counter(), cpu_seconds()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall_s, cpu_s = time.perf_counter() - started, cpu_seconds() - started_cpu
    spent = {key: phases[key] - before[key] for key in phases} if phases is not None else None
    cpu_of = "server process tree" if server_cpu else "this process"
    return LoadRun(list(results), wall_s, cpu_s, load_avg_1m, spent, cpu_of=cpu_of)


def request_cells(row: LoadRow) -> tuple[np.ndarray, np.ndarray]:
    """[rounds, prompts] output tokens and request latencies (the cells of stats.throughput_ratio)."""
    tokens = np.array([[len(r.output_ids) for r in run.requests] for run in row.runs], dtype=np.float64)
    seconds = np.array([[r.latency_s for r in run.requests] for run in row.runs], dtype=np.float64)
    return tokens, seconds


def gap_cells(row: LoadRow) -> list[list[list[float]]]:
    return [[r.chunk_gaps_s for r in run.requests] for run in row.runs]


class PairedRounds:
    """Paired, interleaved rounds: each round runs every engine on the same prompts at every concurrency level.

    Within a round the engines take turns at each level (target alone, candidate, champion, then the next level),
    and the order rotates from round to round, so a slow stretch of the machine hits every engine about equally.
    Engines that can all be up at once stay up for the whole run (`engines_up_together`): the reference engine, and
    vLLM servers, each on a free port. SGLang (one configured port, minutes to start) and vLLM on a configured port
    run one engine at a time per round. The first engine must be the target-only baseline.
    Use as `async with PairedRounds(...) as paired: await paired.run_round(); paired.rows(...)`.
    """

    def __init__(self, cfg: DraftlineConfig, target_dir: Path, engines: list[EngineSpec], prompts: list[BenchPrompt],
                 concurrency_levels: list[int], params: SamplingParams, log=print) -> None:  # fmt: skip
        if not engines or engines[0].drafter_dir is not None:
            raise ValueError("PairedRounds: the first engine must be the target-only baseline (drafter_dir None)")
        self.cfg, self.target_dir, self.engines, self.prompts = cfg, target_dir, engines, prompts
        self.levels, self.params, self.log = concurrency_levels, params, log
        self.keep_loaded = engines_up_together(cfg)
        self.loaded: dict[int, Engine] = {}
        self.runs: dict[int, dict[int, list[LoadRun]]] = {i: {c: [] for c in concurrency_levels} for i in range(len(engines))}
        self.rounds = 0
        self.round_order: list[list[str]] = []  # the engines of each round, in the order they ran

    async def __aenter__(self) -> "PairedRounds":
        if self.keep_loaded:
            for index in range(len(self.engines)):
                self.loaded[index] = await self._start(index)
        return self

    async def __aexit__(self, *exc) -> None:
        for engine in self.loaded.values():
            await engine.stop()
        self.loaded.clear()

    async def _start(self, index: int) -> Engine:
        spec = self.engines[index]
        engine = make_engine(self.cfg, self.target_dir, spec.drafter_dir, spec.model_version, speculative=spec.speculative)
        await engine.start()
        await run_request(engine, self.prompts[0], SamplingParams(max_new_tokens=4))  # warm-up
        return engine

    async def _run(self, index: int, engine: Engine, concurrency: int) -> None:
        spec = self.engines[index]
        counters = getattr(engine, "spec_counters", None) if spec.drafter_dir is not None else None
        before = await counters() if counters is not None else None
        run = await run_load(engine, self.prompts, concurrency, self.params)
        if before is not None:
            run.engine_counters = (await counters()).minus(before)
        self.runs[index][concurrency].append(run)
        tokens = sum(len(r.output_ids) for r in run.requests)
        cpu_ms_per_token = 1000 * run.cpu_s / tokens if tokens else float("nan")
        self.log(f"[bench] round {self.rounds + 1} {spec.label} ({spec.spec_text()}) c={concurrency}: "
                 f"{tokens / run.wall_s:.1f} tok/s, {cpu_ms_per_token:.1f} CPU ms/token ({run.cpu_of}), "
                 f"load {run.load_avg_1m:.2f}")  # fmt: skip

    async def run_round(self) -> None:
        shift = self.rounds % len(self.engines)
        order = list(range(len(self.engines)))[shift:] + list(range(len(self.engines)))[:shift]
        self.round_order.append([self.engines[index].name() for index in order])
        if self.keep_loaded:
            for concurrency in self.levels:
                for index in order:
                    await self._run(index, self.loaded[index], concurrency)
        else:
            for index in order:
                engine = await self._start(index)
                try:
                    for concurrency in self.levels:
                        await self._run(index, engine, concurrency)
                finally:
                    await engine.stop()
        self.rounds += 1

    def schedule(self) -> dict:
        """How the rounds ran, for the report: engines up for the whole run or started per round, and their order."""
        return {"engines_up_together": self.keep_loaded, "round_order": [list(order) for order in self.round_order]}

    def rows(self, confidence: float, bootstrap_samples: int) -> list[LoadRow]:
        """Every engine and level pooled over the rounds so far; speedups (with intervals) against the baseline."""
        rows = {
            (index, c): LoadRow(spec.label, spec.spec_text(), c, self.runs[index][c])
            for index, spec in enumerate(self.engines) for c in self.levels
        }  # fmt: skip
        for (index, concurrency), row in rows.items():
            if index == 0:
                continue
            base = rows[(0, concurrency)]
            row.speedup = throughput_ratio(*request_cells(row), *request_cells(base), confidence, bootstrap_samples,
                                           seed=self.cfg.seed)  # fmt: skip
            base_metrics, row_metrics = base.metrics(), row.metrics()
            for attribute, key in (("cpu_speedup", "output_tokens_per_cpu_s"), ("decode_speedup", "decode_tokens_per_s")):
                setattr(row, attribute, row_metrics[key] / base_metrics[key] if base_metrics[key] else None)
            if self.params.temperature == 0:
                row.lossless = all(
                    a.output_ids == b.output_ids
                    for run, base_run in zip(row.runs, base.runs) for a, b in zip(run.requests, base_run.requests)
                )  # fmt: skip
        return list(rows.values())


def engines_up_together(cfg: DraftlineConfig) -> bool:
    """Whether every engine of a bench can be up at once: in-process engines, and vLLM servers on a free port each."""
    return cfg.engine.backend == "reference" or (cfg.engine.backend == "vllm" and cfg.engine.vllm.port is None)


def machine_load(rows: list[LoadRow]) -> dict:
    """The load seen during the runs: 1-minute load average, and the engines' CPU time (LoadRun.cpu_of) per wall
    second."""
    runs = [run for row in rows for run in row.runs]
    loads = [run.load_avg_1m for run in runs]
    return {
        "cpu_count": os.cpu_count(),
        "load_avg_1m_min": round(min(loads), 2),
        "load_avg_1m_mean": round(sum(loads) / len(loads), 2),
        "load_avg_1m_max": round(max(loads), 2),
        "cpu_s_per_wall_s": round(sum(run.cpu_s for run in runs) / sum(run.wall_s for run in runs), 3),
    }


def format_table(rows: list[dict]) -> str:
    columns = [
        ("label", "engine"), ("spec", "steps/topk/draft"), ("concurrency", "conc"), ("output_tokens_per_s", "tok/s"),
        ("speedup", "speedup"), ("speedup_ci", "speedup interval"), ("cpu_speedup", "cpu speedup"),
        ("cpu_ms_per_token", "cpu ms/tok"), ("decode_speedup", "decode speedup"), ("accept_length", "accept"), ("ttft_ms_p50", "ttft p50 ms"), ("ttft_ms_p99", "ttft p99 ms"),
        ("itl_ms_p50", "itl p50 ms"), ("itl_ms_p99", "itl p99 ms"), ("lossless", "lossless"),
    ]  # fmt: skip
    cells = [[h for _, h in columns]] + [["-" if r.get(k) is None else str(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    measured = sorted({r["cpu_of"] for r in rows if r.get("cpu_of")})
    if measured:
        lines.append(f"cpu speedup, cpu ms/tok: CPU time of {' / '.join(measured)}")
    lines += [line for r in rows if (line := _segment_line(r))]
    return "\n".join(lines)


def _segment_line(row: dict) -> str:
    """'accept by segment, LABEL SPEC cCONC: has-tools 2.1 (3 prompts), plain 2.6 (7 prompts)' for a drafter row."""
    segments = {k: v for k, v in (row.get("accept_length_by_segment") or {}).items() if v["accept_length"] is not None}
    if not segments:
        return ""
    parts = ", ".join(f"{name} {v['accept_length']} ({v['prompts']} prompts)" for name, v in segments.items())
    return f"accept by segment, {row['label']} {row['spec']} c{row['concurrency']}: {parts}"
