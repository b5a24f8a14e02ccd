"""Stage `regenerate` (optional, `regenerate.enabled`): every user turn of data.conversations answered by the target.

System and user turns are kept; every user turn gets the target's reply, turn by turn, conditioned on the
regenerated history before it: an assistant turn that follows it is rewritten, a missing one is written (prompt-only
input, the usual case). The chat template renders the prompt; generation stops at the template's end of turn or
after `regenerate.max_new_tokens_per_turn`. A reasoning target's thinking goes into `reasoning_content`.

Tool use: the record's `tools` are rendered into every prompt, and the recorded tool results are kept (tools are not
run again). The assistant turns around them are the target's: a reply after a tool result is regenerated like one
after a user turn, and a recorded tool-call turn is regenerated too. When the target's turn renders exactly as the
recorded call does (same calls, same arguments, as the template writes them), the recorded call and its results are
kept; when it does not, the recorded result answers a call the target did not make, so the conversation stops there:
the target's own turn is kept as its last message (its text, the call as the target wrote it) and the rest is
dropped; `regenerated.stopped` says at which turn and why, and the manifest counts such conversations.

Scale-out: the conversations are cut into shards; Ray actors (`regenerate.num_replicas`), each holding an engine
(regenerate.engine, default the serving engine, through engines/base.py's protocol, or a connection to running
OpenAI-compatible servers), take
shards from a queue and run `requests_in_flight` conversations at once. The driver writes each finished shard
atomically; a rerun skips finished shards, and a replica that dies is restarted by Ray while its shard goes back
on the queue, so no conversation is lost and none is generated twice into the output.

Output `<data_dir>/regenerated/<hash>/`: shards/shard-NNNNN.jsonl (+ .json: counts, sha256, bad input),
conversations.jsonl (all shards, what prepare reads), manifest.json (written last: provenance and counts),
resolved_config.yaml. With `regenerate.enabled`, prepare reads conversations.jsonl and refuses it when the
manifest's target fingerprint is not the configured target's.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from draftline.config import DraftlineConfig, write_resolved
from draftline.data.conversations import (
    BadInput,
    Conversation,
    DataError,
    NoConversationsError,
    drop_duplicate_ids,
    read_conversations,
)
from draftline.data.masks import TemplateError, end_of_turn_text, render
from draftline.data.sources import (
    MANIFEST_KIND,
    engine_description,
    output_key,
    sampling_settings,
    source_conversations_path,
)
from draftline.data.thinking import check_thinking_switch, thinking_kwargs, thinking_mode
from draftline.engines import make_engine
from draftline.engines.base import SamplingParams
from draftline.raycluster import ensure_ray
from draftline.records import StageRecord
from draftline.regenerate.openai_server import OpenAIServerEngine
from draftline.target.load import resolve_target_dir, target_fingerprint
from draftline.target.reasoning import DEFAULT_REASONING_TAGS, split_reasoning
from draftline.utils import atomic_write_json, atomic_write_text, read_json, sha256_file, stable_fraction, stable_hash

REPLICA_STOP_TIMEOUT_S = 30.0  # a server's stop: SIGTERM, 15 s grace, SIGKILL (engines/server_process.py)


def _log(msg: str) -> None:
    print(f"[regenerate] {msg}", flush=True)


# ------------------------------------------------------------------------------------------- one conversation


@dataclass(frozen=True)
class TurnSettings:
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    stop_token_ids: tuple[int, ...]
    end_of_turn: str
    reasoning_tags: Optional[tuple[str, str]]
    thinking: Optional[str] = None  # data.thinking
    thinking_on_fraction: float = 0.5


def turn_settings(cfg: DraftlineConfig, tokenizer) -> TurnSettings:
    eot = end_of_turn_text(tokenizer)
    stop_ids = tuple(tokenizer.convert_tokens_to_ids([eot])) if eot else ()
    tags = cfg.regenerate.reasoning_tags
    if tags is None:
        vocab = tokenizer.get_vocab()
        tags = DEFAULT_REASONING_TAGS if all(t in vocab for t in DEFAULT_REASONING_TAGS) else None
    regen = cfg.regenerate
    return TurnSettings(regen.temperature, regen.top_p, regen.max_new_tokens_per_turn, cfg.seed, stop_ids, eot,
                        tuple(tags) if tags else None, cfg.data.thinking, cfg.data.thinking_on_fraction)


def _prompt_ids(tokenizer, history: list[dict], tools: Optional[list[dict]], template_kwargs: dict) -> list[int]:
    text = render(tokenizer, history, tools, add_generation_prompt=True, template_kwargs=template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class ReplySlot:
    """Where the target replies; `recorded` is the assistant turn the source had there (None: inserted)."""

    recorded: Optional[dict] = None


def reply_slots(messages: list[dict]) -> list[dict | ReplySlot]:
    """The conversation as regenerated output is laid out: kept turns (system, user, tool results), and a ReplySlot
    where the target replies (after every user turn and every run of tool results: in place of the assistant turn
    that follows it, or inserted where none does)."""
    slots: list[dict | ReplySlot] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            slots.append(ReplySlot(message))
            continue
        slots.append(message)
        following = messages[i + 1]["role"] if i + 1 < len(messages) else None
        awaits_reply = message["role"] == "user" or (message["role"] == "tool" and following != "tool")
        if awaits_reply and following != "assistant":
            slots.append(ReplySlot())
    return slots


def recorded_call_if_reproduced(tokenizer, history: list[dict], tools: Optional[list[dict]], recorded: dict,
                                generated: str, reasoning: Optional[str], end_of_turn: str,
                                template_kwargs: dict) -> Optional[dict]:
    """The recorded tool-call turn (with the target's reasoning) when the template renders it as exactly the text the
    target generated, else None. Compared as rendered text, so no per-template call parser is needed."""
    for content in dict.fromkeys((recorded.get("content") or "", "")):
        candidate = {"role": "assistant", "content": content, "tool_calls": recorded["tool_calls"]}
        if reasoning is not None:
            candidate["reasoning_content"] = reasoning
        try:
            prompt = render(tokenizer, history, tools, add_generation_prompt=True, template_kwargs=template_kwargs)
            whole = render(tokenizer, history + [candidate], tools, template_kwargs=template_kwargs)
        except TemplateError:
            return None
        if not whole.startswith(prompt):
            return None
        rendered = whole[len(prompt):]
        if end_of_turn:
            rendered = rendered.split(end_of_turn, 1)[0]
        if rendered.strip() == generated.strip():
            return candidate
    return None


async def regenerate_conversation(engine, tokenizer, conversation: dict, settings: TurnSettings) -> dict:
    """One conversation, turn by turn -> {"id", "messages", "tools"?, "regenerated": {...}}. ValueError: the engine
    refused a turn."""
    tools = conversation.get("tools")
    thinking = thinking_mode(settings.thinking, conversation["id"], settings.thinking_on_fraction)
    template_kwargs = thinking_kwargs(tokenizer, thinking)
    history: list[dict] = []
    finish_reasons: list[Optional[str]] = []
    output_tokens = 0
    stopped = None
    for turn_index, slot in enumerate(reply_slots(conversation["messages"])):
        if not isinstance(slot, ReplySlot):
            history.append(dict(slot))
            continue
        params = SamplingParams(
            max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
            # per turn, so a resumed shard samples what the first attempt would have
            seed=int(stable_hash(settings.seed, conversation["id"], turn_index)[:12], 16),
            stop_token_ids=list(settings.stop_token_ids),
        )
        pieces: list[str] = []
        tokens = 0
        async for chunk in engine.generate(_prompt_ids(tokenizer, history, tools, template_kwargs), params):
            pieces.append(chunk.text)
            tokens += len(chunk.token_ids)
            if chunk.finished:
                finish_reasons.append(chunk.finish_reason)
                tokens = chunk.stats.output_tokens if chunk.stats and chunk.stats.output_tokens else tokens
        output_tokens += tokens
        text = "".join(pieces)
        if settings.end_of_turn and settings.end_of_turn in text:
            text = text.split(settings.end_of_turn, 1)[0]
        content, reasoning = split_reasoning(text, settings.reasoning_tags)
        reply = {"role": "assistant", "content": content}
        if reasoning is not None:
            reply["reasoning_content"] = reasoning
        if slot.recorded is not None and slot.recorded.get("tool_calls"):
            same = recorded_call_if_reproduced(tokenizer, history, tools, slot.recorded, text, reasoning,
                                               settings.end_of_turn, template_kwargs)
            if same is None:
                history.append(reply)
                stopped = {"turn": len(history) - 1, "reason": "the target's turn differs from the recorded tool "
                           "call, so the recorded tool result cannot follow it"}
                break
            reply = same
        history.append(reply)
    record = {"id": conversation["id"], "messages": history}
    if tools:
        record["tools"] = tools
    if thinking:
        record["thinking"] = thinking
    record["regenerated"] = {"output_tokens": output_tokens, "finish_reasons": finish_reasons}
    if stopped:
        record["regenerated"]["stopped"] = stopped
    return record


# ------------------------------------------------------------------------------------------------ replicas


def build_engine(cfg: DraftlineConfig, target_dir: Path, replica_index: int):
    """The engine a replica regenerates with, through the protocol of engines/base.py."""
    regen = cfg.regenerate
    if regen.openai_base_urls:
        url = regen.openai_base_urls[replica_index % len(regen.openai_base_urls)]
        return OpenAIServerEngine(url, regen.openai_model, regen.api_key_env, regen.request_timeout_s,
                                  max_connections=regen.requests_in_flight)

    return make_engine(cfg.model_copy(update={"engine": cfg.regenerate_engine}), target_dir)


class RegenerateReplica:
    """A Ray actor (async: `progress` answers while shards generate) holding one engine."""

    def __init__(self, cfg_json: dict, target_dir: str, replica_index: int) -> None:
        from transformers import AutoTokenizer

        self.cfg = DraftlineConfig.model_validate(cfg_json)
        self.target_dir = Path(target_dir)
        self.replica_index = replica_index
        self.tokenizer = AutoTokenizer.from_pretrained(self.target_dir, trust_remote_code=self.cfg.target.trust_remote_code)
        self.settings = turn_settings(self.cfg, self.tokenizer)
        self.engine = None
        self._starting = asyncio.Lock()
        self.shard_counts = {"conversations": 0, "output_tokens": 0}

    async def _ready(self):
        async with self._starting:
            if self.engine is None:
                engine = build_engine(self.cfg, self.target_dir, self.replica_index)
                await engine.start()
                self.engine = engine
        return self.engine

    async def run_shard(self, conversations: list[dict]) -> list[dict]:
        """-> per conversation {"record": ...} or {"failure": message}."""
        engine = await self._ready()
        self.shard_counts = {"conversations": 0, "output_tokens": 0}
        in_flight = asyncio.Semaphore(self.cfg.regenerate.requests_in_flight)

        async def one(conversation: dict) -> dict:
            async with in_flight:
                try:
                    record = await regenerate_conversation(engine, self.tokenizer, conversation, self.settings)
                except ValueError as err:
                    return {"failure": str(err)}
            self.shard_counts["conversations"] += 1
            self.shard_counts["output_tokens"] += record["regenerated"]["output_tokens"]
            return {"record": record}

        return await asyncio.gather(*(one(c) for c in conversations))

    async def progress(self) -> dict:
        return dict(self.shard_counts)

    async def stop(self) -> None:
        """Stop the engine before the actor is killed: Ray SIGKILLs an exiting worker's children, and the engine's
        supervisor would take its server's end for a crash."""
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.stop()


# ----------------------------------------------------------------------------------------------- the stage


@dataclass
class RegenerateResult:
    out_dir: Path
    conversations: int
    output_tokens: int
    shards_total: int
    shards_generated: int  # this run; the others were finished before
    replica_deaths: int
    bad_input: int
    seconds: float

    def to_record(self) -> "RegenerateRecord":
        return RegenerateRecord(
            dataset_dir=str(self.out_dir), conversations=str(self.out_dir / "conversations.jsonl"),
            samples=self.conversations, output_tokens=self.output_tokens, shards_total=self.shards_total,
            shards_generated=self.shards_generated, replica_deaths=self.replica_deaths, bad_input=self.bad_input,
        )


@dataclass(frozen=True)
class RegenerateRecord(StageRecord):
    """The regenerate stage's output, as its stage record keeps it (RegenerateResult less the timing)."""

    STAGE = "regenerate"
    dataset_dir: str
    conversations: str  # the regenerated conversations.jsonl
    samples: int
    output_tokens: int
    shards_total: int
    shards_generated: int
    replica_deaths: int
    bad_input: int


def stable_sample(conversations: list[Conversation], limit: Optional[int]) -> list[Conversation]:
    """The `limit` conversations with the lowest id hash, in source order: the same sample on every run and machine."""
    if limit is None or limit >= len(conversations):
        return conversations
    chosen = {c.id for c in sorted(conversations, key=lambda c: stable_fraction("regenerate:" + c.id))[:limit]}
    return [c for c in conversations if c.id in chosen]


def _shard_paths(out_dir: Path, index: int) -> tuple[Path, Path]:
    stem = out_dir / "shards" / f"shard-{index:05d}"
    return stem.with_suffix(".jsonl"), stem.with_suffix(".json")


def _finished_shard(out_dir: Path, index: int) -> Optional[dict]:
    data_path, info_path = _shard_paths(out_dir, index)
    if not (data_path.exists() and info_path.exists()):
        return None
    info = read_json(info_path)
    return info if info.get("sha256") == sha256_file(data_path) else None


def _write_shard(out_dir: Path, index: int, shard: list[Conversation], results: list[dict]) -> dict:
    records, problems, finish = [], [], Counter()
    for conv, result in zip(shard, results):
        if "record" in result:
            records.append(result["record"])
            finish.update(str(r) for r in result["record"]["regenerated"]["finish_reasons"])
        else:
            problems.append(asdict(BadInput(conv.file, conv.line, "regenerate_failed", result["failure"])))
    data_path, info_path = _shard_paths(out_dir, index)
    atomic_write_text(data_path, "".join(json.dumps(r) + "\n" for r in records))
    info = {"conversations": len(records), "output_tokens": sum(r["regenerated"]["output_tokens"] for r in records),
            "finish_reasons": dict(finish), "bad_input": problems, "sha256": sha256_file(data_path),
            "stopped_at_tool_call": sum(1 for r in records if "stopped" in r["regenerated"])}
    atomic_write_json(info_path, info)
    return info


def _progress_bar():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[regenerate] conversations"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[conversations_per_s]:.2f} conv/s, {task.fields[tokens_per_s]:.0f} tok/s"),
        TimeElapsedColumn(), TimeRemainingColumn(),
    )


class ReplicaPool:
    """Shards from a queue to Ray actors; a dead actor's shard goes back on the queue (Ray restarts the actor)."""

    def __init__(self, cfg: DraftlineConfig, target_dir: Path) -> None:
        import ray

        regen = cfg.regenerate
        actor = ray.remote(RegenerateReplica).options(
            num_cpus=regen.cpus_per_replica, num_gpus=regen.gpus_per_replica,
            max_restarts=regen.max_restarts, max_task_retries=0, max_concurrency=regen.requests_in_flight + 4,
        )
        cfg_json = cfg.model_dump(mode="json")
        self.replicas = [actor.remote(cfg_json, str(target_dir), i) for i in range(regen.num_replicas)]
        self.max_restarts = regen.max_restarts
        self.regen = regen

    def wait_until_started(self) -> None:
        """Every replica answers a first ping (Ray placed it, its engine loaded) within
        regenerate.replica_start_timeout_s, or the error names what it asks for and what the cluster has free: a
        replica Ray cannot place (its CPUs held by a Serve app, say) was otherwise waited for forever."""
        import ray

        pings = {replica.progress.remote(): i for i, replica in enumerate(self.replicas)}
        _, waiting = ray.wait(list(pings), num_returns=len(pings), timeout=self.regen.replica_start_timeout_s)
        if waiting:
            free, total = ray.available_resources(), ray.cluster_resources()
            raise RuntimeError(
                f"regenerate replica(s) {sorted(pings[ref] for ref in waiting)} did not start within "
                f"regenerate.replica_start_timeout_s={self.regen.replica_start_timeout_s:g} s: each asks for "
                f"{self.regen.cpus_per_replica:g} CPU and {self.regen.gpus_per_replica:g} GPU "
                f"(regenerate.cpus_per_replica, regenerate.gpus_per_replica); the Ray cluster has "
                f"{free.get('CPU', 0):g} of {total.get('CPU', 0):g} CPUs and {free.get('GPU', 0):g} of "
                f"{total.get('GPU', 0):g} GPUs free. Free what holds them (a Serve app, another job), lower those "
                "settings or regenerate.num_replicas, or raise the timeout if the engine is that slow to load"
            )

    def run(self, shards: dict[int, list[Conversation]], on_shard_done, on_progress) -> int:
        """Run every shard; on_shard_done(index, results) as each finishes. -> replica deaths seen.

        A replica whose shard failed with RayActorError is pinged until Ray has restarted it (ActorUnavailableError
        meanwhile); ActorDiedError on a ping means Ray gave up on it (regenerate.max_restarts).
        """
        import ray
        from ray.exceptions import ActorDiedError, RayActorError

        queue = deque(sorted(shards))
        busy: dict = {}  # run_shard ObjectRef -> (replica index, shard index)
        recovering: dict = {}  # ping ObjectRef -> replica index
        idle = list(range(len(self.replicas)))
        deaths = 0
        while queue or busy:
            while queue and idle:
                replica, index = idle.pop(0), queue.popleft()
                payload = [{"id": c.id, "messages": c.messages, "tools": c.tools} for c in shards[index]]
                busy[self.replicas[replica].run_shard.remote(payload)] = (replica, index)
            if not busy and not recovering:
                raise RuntimeError(
                    f"every regenerate replica is dead (each restarted at most regenerate.max_restarts="
                    f"{self.max_restarts} times); finished shards are kept: fix the cause (see the replica logs) "
                    "and rerun to resume"
                )
            ready, _ = ray.wait(list(busy) + list(recovering), num_returns=1, timeout=0.5)
            for ref in ready:
                if ref in recovering:
                    replica = recovering.pop(ref)
                    try:
                        ray.get(ref)
                    except ActorDiedError:
                        _log(f"replica {replica} is dead for good (regenerate.max_restarts={self.max_restarts})")
                    except RayActorError:
                        time.sleep(0.5)  # still restarting
                        recovering[self.replicas[replica].progress.remote()] = replica
                    else:
                        _log(f"replica {replica} is back")
                        idle.append(replica)
                    continue
                replica, index = busy.pop(ref)
                try:
                    results = ray.get(ref)
                except RayActorError as err:
                    deaths += 1
                    queue.appendleft(index)
                    _log(f"replica {replica} died on shard {index} ({type(err).__name__}); shard requeued")
                    recovering[self.replicas[replica].progress.remote()] = replica
                else:
                    on_shard_done(index, results)
                    idle.append(replica)
            on_progress(self._in_flight_counts(busy))
        return deaths

    def _in_flight_counts(self, busy: dict) -> dict:
        import ray

        refs = [self.replicas[replica].progress.remote() for replica, _ in busy.values()]
        counts = {"conversations": 0, "output_tokens": 0}
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5)
        for ref in ready:
            try:
                for key, value in ray.get(ref).items():
                    counts[key] += value
            except ray.exceptions.RayActorError:
                continue  # a dead replica's partial shard counts for nothing: it is generated again
        return counts

    def shutdown(self) -> None:
        """Each replica stops its engine (a dead one has none to stop), then the actors go."""
        import ray

        stops = [replica.stop.remote() for replica in self.replicas]
        ray.wait(stops, num_returns=len(stops), timeout=REPLICA_STOP_TIMEOUT_S)
        for replica in self.replicas:
            ray.kill(replica, no_restart=True)


def regenerate(cfg: DraftlineConfig, target_dir: Optional[Path] = None) -> RegenerateResult:
    started = time.monotonic()
    target_dir = Path(target_dir) if target_dir is not None else resolve_target_dir(cfg)
    source = source_conversations_path(cfg, target_dir)
    source_sha256 = sha256_file(source)
    target_fp = target_fingerprint(target_dir)
    out_dir = cfg.data_path("regenerated", output_key(cfg, source_sha256, target_fp))

    if cfg.data.thinking:
        from transformers import AutoTokenizer  # heavy: loaded only to check the template's thinking switch

        check_thinking_switch(AutoTokenizer.from_pretrained(target_dir, trust_remote_code=cfg.target.trust_remote_code),
                              cfg.data.thinking)
    conversations, problems = read_conversations(source, cfg.data.format, need_reply=False)
    records_read = len(conversations) + len(problems)
    conversations, duplicates = drop_duplicate_ids(conversations)
    problems += duplicates
    if problems and cfg.data.on_bad_input == "fail":
        raise DataError(problems)
    if not conversations:
        raise NoConversationsError(source, records_read, problems, "give conversations or prompts with a user turn "
                                   "(formats: docs/regenerate.md), or fix data.format")
    selected = stable_sample(conversations, cfg.regenerate.limit)
    per_shard = cfg.regenerate.conversations_per_shard
    shards = {i // per_shard: selected[i : i + per_shard] for i in range(0, len(selected), per_shard)}
    finished = {i: info for i in shards if (info := _finished_shard(out_dir, i)) is not None}
    todo = {i: shard for i, shard in shards.items() if i not in finished}
    _log(f"{len(selected)} of {records_read} conversations from {source} in {len(shards)} shards "
         f"({len(finished)} finished before); engine {engine_description(cfg)['backend']}, target {target_fp}")

    deaths = 0
    if todo:
        ensure_ray(cfg)
        pool = ReplicaPool(cfg, target_dir)
        run_started = time.monotonic()
        before = sum(len(shards[i]) for i in finished)
        this_run = {"conversations": 0, "output_tokens": 0}  # finished shards of this run
        try:
            pool.wait_until_started()
            with _progress_bar() as progress:
                task = progress.add_task("regenerate", total=len(selected), completed=before,
                                         conversations_per_s=0.0, tokens_per_s=0.0)

                def on_shard_done(index: int, results: list[dict]) -> None:
                    finished[index] = _write_shard(out_dir, index, shards[index], results)
                    this_run["conversations"] += len(shards[index])
                    this_run["output_tokens"] += finished[index]["output_tokens"]

                def on_progress(in_flight: dict) -> None:
                    seconds = max(time.monotonic() - run_started, 1e-9)
                    conversations = this_run["conversations"] + in_flight["conversations"]
                    progress.update(task, completed=before + conversations, conversations_per_s=conversations / seconds,
                                    tokens_per_s=(this_run["output_tokens"] + in_flight["output_tokens"]) / seconds)

                deaths = pool.run(todo, on_shard_done, on_progress)
        finally:
            pool.shutdown()

    problems += [BadInput(**p) for i in sorted(shards) for p in finished[i]["bad_input"]]
    if problems and cfg.data.on_bad_input == "fail":
        raise DataError(problems)
    merged = out_dir / "conversations.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(merged.with_suffix(".tmp"), "w") as handle:
        for i in sorted(shards):
            handle.write(_shard_paths(out_dir, i)[0].read_text())
    os.replace(merged.with_suffix(".tmp"), merged)
    by_kind = Counter(p.kind for p in problems)
    finish = Counter()
    for info in finished.values():
        finish.update(info["finish_reasons"])
    manifest = {
        "kind": MANIFEST_KIND,
        "target_fingerprint": target_fp,
        "target_dir": str(target_dir),
        "engine": engine_description(cfg),
        "sampling": sampling_settings(cfg),
        "source": {"path": str(source), "sha256": source_sha256, "format": cfg.data.format, "records_read": records_read,
                   "limit": cfg.regenerate.limit, "selected": len(selected)},
        "conversations": sum(info["conversations"] for info in finished.values()),
        "output_tokens": sum(info["output_tokens"] for info in finished.values()),
        "finish_reasons": dict(finish),
        # conversations cut at a tool call the target made differently from the recorded one (module docstring)
        "stopped_at_tool_call": sum(info.get("stopped_at_tool_call", 0) for info in finished.values()),
        "shards": [{"file": _shard_paths(out_dir, i)[0].name, **{k: finished[i][k] for k in ("conversations", "output_tokens", "sha256")}}
                   for i in sorted(shards)],
        "conversations_sha256": sha256_file(merged),
        "bad_input": {"policy": cfg.data.on_bad_input, "count": len(problems), "by_kind": dict(by_kind),
                      "items": [str(p) for p in problems]},
    }
    write_resolved(cfg, out_dir)
    atomic_write_json(out_dir / "manifest.json", manifest)
    return RegenerateResult(out_dir, manifest["conversations"], manifest["output_tokens"], len(shards), len(todo), deaths,
                            len(problems), time.monotonic() - started)


def summary_text(result: RegenerateResult) -> str:
    manifest = read_json(result.out_dir / "manifest.json")
    rate = f"{manifest['output_tokens'] / result.seconds:.0f} tok/s overall" if result.seconds else ""
    lines = [
        f"regenerated {result.out_dir}",
        f"  {result.conversations} conversations, {result.output_tokens} generated tokens in {result.seconds:.1f} s ({rate})",
        f"  shards: {result.shards_generated} generated now, {result.shards_total - result.shards_generated} finished before; "
        f"replica deaths {result.replica_deaths}",
        f"  finish reasons: {manifest['finish_reasons']}",
        f"  stopped at a tool call the target made differently: {manifest['stopped_at_tool_call']}",
        f"  bad input: {manifest['bad_input']['count']} ({', '.join(f'{k}={v}' for k, v in manifest['bad_input']['by_kind'].items()) or 'none'})",
    ]
    lines += [f"    {item}" for item in manifest["bad_input"]["items"][:5]]
    return "\n".join(lines)
