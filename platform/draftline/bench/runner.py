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
  speedup              output_tokens_per_s / the target-only engine's at the same concurrency
  decode_speedup       decode_tokens_per_s / the target-only engine's
  cpu_speedup          the output_tokens_per_s ratio on this process's CPU time (time.process_time) instead of wall time:
                       for in-process engines on a shared machine it ignores other processes' load
  lossless             greedy only: every output is token-identical to the target-only engine's
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from draftline.config import DraftlineConfig, SpeculativeConfig
from draftline.engines.base import TARGET_ONLY, Engine, SamplingParams, SpecStats

from draftline.bench.prompts import BenchPrompt

BASELINE = TARGET_ONLY  # the label of the bench row every speedup is relative to


@dataclass
class RequestResult:
    prompt_id: str
    output_ids: list[int]
    ttft_s: float
    chunk_gaps_s: list[float]
    latency_s: float
    stats: SpecStats


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


@dataclass
class LoadRow:
    label: str
    spec: str  # "steps/topk/draft_tokens" or "-"
    concurrency: int
    requests: list[RequestResult] = field(repr=False)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    speedup: Optional[float] = None
    cpu_speedup: Optional[float] = None
    decode_speedup: Optional[float] = None
    lossless: Optional[bool] = None
    engine_counters: Optional[Any] = None  # the engine's own speculative counters over this load (vLLM)

    def metrics(self) -> dict:
        output_tokens = sum(len(r.output_ids) for r in self.requests)
        stats = SpecStats()
        for r in self.requests:
            stats = stats.merge(r.stats)
        gaps = [g for r in self.requests for g in r.chunk_gaps_s]
        tpots = [(r.latency_s - r.ttft_s) / (len(r.output_ids) - 1) for r in self.requests if len(r.output_ids) > 1]
        ttfts = [r.ttft_s for r in self.requests]
        decode_tokens = sum(len(r.output_ids) - 1 for r in self.requests if r.output_ids)
        decode_s = sum(r.latency_s - r.ttft_s for r in self.requests if r.output_ids)
        return {
            "label": self.label,
            "spec": self.spec,
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "output_tokens": output_tokens,
            "wall_s": round(self.wall_s, 4),
            "output_tokens_per_s": round(output_tokens / self.wall_s, 2) if self.wall_s else 0.0,
            "output_tokens_per_cpu_s": round(output_tokens / self.cpu_s, 2) if self.cpu_s else 0.0,
            "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s else 0.0,
            "ttft_ms_p50": _ms(percentile(ttfts, 50)),
            "ttft_ms_p99": _ms(percentile(ttfts, 99)),
            "itl_ms_p50": _ms(percentile(gaps, 50)),
            "itl_ms_p99": _ms(percentile(gaps, 99)),
            "tpot_ms_p50": _ms(percentile(tpots, 50)),
            "accept_length": _accept_length(stats, self.engine_counters),
            "engine_counters": self.engine_counters.as_dict() if self.engine_counters is not None else None,
            "speedup": round(self.speedup, 3) if self.speedup is not None else None,
            "cpu_speedup": round(self.cpu_speedup, 3) if self.cpu_speedup is not None else None,
            "decode_speedup": round(self.decode_speedup, 3) if self.decode_speedup is not None else None,
            "lossless": self.lossless,
            "per_request_accept_lengths": [round(r.stats.accept_length, 3) for r in self.requests if r.stats.verify_steps],
        }


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
    return RequestResult(prompt.id, output, (first or finished) - started, gaps, finished - started, stats)


async def run_load(engine: Engine, prompts: list[BenchPrompt], concurrency: int, params: SamplingParams):
    """All prompts, at most `concurrency` in flight -> (results in prompt order, wall seconds, CPU seconds)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: BenchPrompt) -> RequestResult:
        async with gate:
            return await run_request(engine, prompt, params)

    started, started_cpu = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return list(results), time.perf_counter() - started, time.process_time() - started_cpu


async def bench_engines(
    cfg: DraftlineConfig,
    target_dir: Path,
    engines: list[EngineSpec],
    prompts: list[BenchPrompt],
    concurrency_levels: list[int],
    params: SamplingParams,
    log=print,
) -> list[LoadRow]:
    """Run every engine (one at a time: SGLang engines share a port) over every concurrency level.

    The first engine must be the target-only baseline: speedups and losslessness are relative to it.
    With bench.rounds > 1 the whole sequence repeats and each row keeps its fastest round, so a burst of
    load on a shared machine does not favour whichever engine ran at a quiet moment.
    """
    from draftline.engines import make_engine

    if not engines or engines[0].drafter_dir is not None:
        raise ValueError("bench_engines: the first engine must be the target-only baseline (drafter_dir None)")
    fastest: dict[tuple[str, str, int], LoadRow] = {}
    for round_index in range(cfg.bench.rounds):
        for spec in engines:
            engine = make_engine(cfg, target_dir, spec.drafter_dir, spec.model_version, speculative=spec.speculative)
            await engine.start()
            try:
                await run_request(engine, prompts[0], SamplingParams(max_new_tokens=4))  # warm-up
                counters = getattr(engine, "spec_counters", None) if spec.drafter_dir is not None else None
                for concurrency in concurrency_levels:
                    before = await counters() if counters is not None else None
                    results, wall_s, cpu_s = await run_load(engine, prompts, concurrency, params)
                    row = LoadRow(spec.label, spec.spec_text(), concurrency, results, wall_s, cpu_s)
                    if before is not None:
                        row.engine_counters = (await counters()).minus(before)
                    key = (row.label, row.spec, concurrency)
                    if key not in fastest or row.wall_s < fastest[key].wall_s:
                        fastest[key] = row
                    m = row.metrics()
                    log(
                        f"[bench] round {round_index + 1}/{cfg.bench.rounds} {spec.label} ({row.spec}) c={concurrency}: "
                        f"{m['output_tokens_per_s']} tok/s, accept {m['accept_length']}, itl p50 {m['itl_ms_p50']} ms"
                    )
            finally:
                await engine.stop()
    rows = list(fastest.values())
    baseline = {row.concurrency: row for row in rows if row.label == engines[0].label}
    for row in rows:
        base = baseline[row.concurrency]
        base_metrics, row_metrics = base.metrics(), row.metrics()
        ratios = (
            ("speedup", "output_tokens_per_s"),
            ("cpu_speedup", "output_tokens_per_cpu_s"),
            ("decode_speedup", "decode_tokens_per_s"),
        )
        for attribute, key in ratios:
            setattr(row, attribute, row_metrics[key] / base_metrics[key] if base_metrics[key] else None)
        if params.temperature == 0:
            row.lossless = all(a.output_ids == b.output_ids for a, b in zip(row.requests, base.requests))
    return rows


def format_table(rows: list[dict]) -> str:
    columns = [
        ("label", "engine"), ("spec", "steps/topk/draft"), ("concurrency", "conc"), ("output_tokens_per_s", "tok/s"),
        ("speedup", "speedup"), ("decode_speedup", "decode speedup"), ("cpu_speedup", "cpu speedup"),
        ("accept_length", "accept"), ("ttft_ms_p50", "ttft p50 ms"), ("ttft_ms_p99", "ttft p99 ms"),
        ("itl_ms_p50", "itl p50 ms"), ("itl_ms_p99", "itl p99 ms"), ("lossless", "lossless"),
    ]  # fmt: skip
    cells = [[h for _, h in columns]] + [["-" if r.get(k) is None else str(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
