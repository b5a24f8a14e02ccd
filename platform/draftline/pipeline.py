"""`draftline run`: the whole platform as one job.

bootstrap (embedded or gguf) -> regenerate (regenerate.enabled) -> prepare -> extract -> train (+export, register) -> gate -> promote -> serve.

Each stage records what it was run on (a hash of its config sections and its upstream outputs) and what it produced
(its typed record, draftline.records) in `<data_dir>/pipeline/<config name>/stages/<stage>.json`. A stage whose
record matches and whose outputs still exist is skipped, so a rerun after a failure continues where it stopped;
`--from STAGE` forces that stage and what follows. A stage whose output is a process (serve: a live endpoint) also
has to be running now, for this run, to be skipped.
Each stage's output goes to `<...>/logs/<stage>.log`, and only draftline's own lines also to the terminal
(draftline.stagelog); what comes between stages goes to `<...>/logs/pipeline.log` the same way. The final report is
printed and written as report.md.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, TypeVar

from draftline.config import ConfigError, DraftlineConfig, write_resolved
from draftline.data.prepare import PrepareRecord, prepare
from draftline.data.prepare import summary_text as prepare_summary
from draftline.extract.online import online_extract_summary
from draftline.extract.run import ExtractRecord, extract_with_stats
from draftline.extract.run import summary_text as extract_summary
from draftline.gate import GateRecord, run_gate
from draftline.raycluster import configured_ray_address, local_ray_stopped_at_the_end, ray_job_runtime_env
from draftline.records import StageRecord
from draftline.regenerate.run import RegenerateRecord, regenerate
from draftline.regenerate.run import summary_text as regenerate_summary
from draftline.release import PromoteRecord, promote_and_roll
from draftline.report import serving_line, write_report
from draftline.serving.control import serve_champion, smoke_chat_completion
from draftline.serving.liveness import ServeRecord, current_cluster, refuse_foreign_port, serving_at_exit, serving_now
from draftline.stagelog import stage_log
from draftline.target.bootstrap import BootstrapRecord, bootstrap_target
from draftline.target.load import resolve_target_dir
from draftline.train.run import TrainResult, train
from draftline.utils import atomic_write_json, read_json, stable_hash


R = TypeVar("R", bound=StageRecord)


@dataclass
class Context:
    cfg: DraftlineConfig
    outputs: dict[str, StageRecord] = field(default_factory=dict)  # stage -> its recorded outputs
    keep_serving: bool = False

    def record(self, record_type: type[R]) -> R:
        """The output of the stage that writes `record_type`, run or read back earlier in this run."""
        return self.outputs[record_type.STAGE]  # of that type: Stage.record ties each stage's name to its type


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Context], StageRecord]
    record: type[StageRecord]  # what `run` returns and the stage's record file holds as its outputs
    # Config sections and upstream stages the stage's result depends on (its skip key).
    sections: tuple[str, ...]
    upstream: tuple[str, ...]
    applies: Callable[[DraftlineConfig], bool] = lambda cfg: True
    # Outputs that must still exist for a recorded result to count (paths).
    output_paths: tuple[str, ...] = ()
    # For a stage whose output is a process, not files: why its recorded outputs no longer hold now (None: they do).
    still_running: Optional[Callable[[Context, StageRecord], Optional[str]]] = None
    # Settings the stage's result depends on that are not a whole section (part of its skip key).
    derived: Callable[[DraftlineConfig], dict] = lambda cfg: {}


def _stage_bootstrap(ctx: Context) -> BootstrapRecord:
    return BootstrapRecord.of(bootstrap_target(ctx.cfg))


def _target_dir(ctx: Context) -> Path:
    if "bootstrap" in ctx.outputs:
        return Path(ctx.record(BootstrapRecord).target_dir)
    return resolve_target_dir(ctx.cfg)


def _stage_regenerate(ctx: Context) -> RegenerateRecord:
    result = regenerate(ctx.cfg, _target_dir(ctx))
    print(regenerate_summary(result))
    return result.to_record()


def _stage_prepare(ctx: Context) -> PrepareRecord:
    dataset_dir = prepare(ctx.cfg, _target_dir(ctx))
    print(prepare_summary(dataset_dir))
    return PrepareRecord.of(dataset_dir)


def _stage_extract(ctx: Context) -> ExtractRecord:
    if ctx.cfg.extract.mode == "online":
        return _online_extract(ctx)

    result = extract_with_stats(ctx.cfg, ctx.record(PrepareRecord).dataset_dir)
    print(extract_summary(list(result.splits.values())))
    return ExtractRecord.offline(result)


def _online_extract(ctx: Context) -> ExtractRecord:
    """extract.mode=online: nothing to write; the train stage runs the target in its stream (extract/online.py)."""
    summary = online_extract_summary(ctx.cfg, _target_dir(ctx), ctx.record(PrepareRecord).dataset_dir)
    print(summary["line"])
    return ExtractRecord.online(summary["bytes_per_token"], summary["aux_layer_ids"])


def _stage_train(ctx: Context) -> TrainResult:
    return train(
        ctx.cfg,
        hidden_dir=ctx.record(ExtractRecord).hidden_dir,
        dataset_dir=ctx.record(PrepareRecord).dataset_dir,
        target_dir=_target_dir(ctx),
    )


def _stage_gate(ctx: Context) -> GateRecord:
    return run_gate(ctx.cfg, version=ctx.record(TrainResult).model_version).to_record()


def _stage_promote(ctx: Context) -> PromoteRecord:
    # One transaction over registry and serving: a live app for this data dir rolls before the alias moves.
    gate = ctx.record(GateRecord)
    if not gate.passed:
        print(f"[promote] version {gate.version} failed the gate: {'; '.join(gate.reasons)}; champion unchanged")
        return PromoteRecord(promoted=False, version=gate.version)
    print(f"[promote] {promote_and_roll(ctx.cfg, gate.version)}")
    return PromoteRecord(promoted=True, version=gate.version)


def _stage_serve(ctx: Context) -> ServeRecord:
    refuse_foreign_port(ctx.cfg)
    url = serve_champion(ctx.cfg)
    reply = smoke_chat_completion(ctx.cfg, url)
    print(f"[serve] {url}/v1/chat/completions -> {reply['content']!r} (version {reply['version']})")
    cluster = current_cluster(ctx.cfg)
    return ServeRecord(url=url, version=reply["version"], completion=reply["content"],
                       ray_address=cluster["ray_address"], ray_session=cluster["ray_session"],
                       local_cluster=not configured_ray_address(ctx.cfg))


def _serve_still_running(ctx: Context, recorded: ServeRecord) -> Optional[str]:
    now = serving_now(ctx.cfg, recorded)
    return None if now["serving"] else now["reason"]


def _regenerate_engine_key(cfg: DraftlineConfig) -> dict:
    """The engine regenerate runs, target only: the speculative settings the gate and serving use change nothing."""
    return {"engine": cfg.regenerate_engine.model_dump(mode="json", exclude={"speculative"})}


STAGES: tuple[Stage, ...] = (
    Stage("bootstrap", _stage_bootstrap, BootstrapRecord, ("target", "seed"), (),
          applies=lambda cfg: cfg.target.kind in ("embedded", "gguf"), output_paths=("target_dir",)),
    Stage("regenerate", _stage_regenerate, RegenerateRecord, ("regenerate", "data", "seed"), ("bootstrap",),
          applies=lambda cfg: cfg.regenerate.enabled, output_paths=("conversations",), derived=_regenerate_engine_key),
    Stage("prepare", _stage_prepare, PrepareRecord, ("data",), ("bootstrap", "regenerate"),
          output_paths=("dataset_dir",)),
    Stage("extract", _stage_extract, ExtractRecord, ("extract", "target"), ("prepare",), output_paths=("hidden_dir",)),
    Stage("train", _stage_train, TrainResult, ("train", "tracking"), ("extract",), output_paths=("export_dir",)),
    Stage("gate", _stage_gate, GateRecord, ("gate", "bench", "engine"), ("train",)),
    Stage("promote", _stage_promote, PromoteRecord, ("tracking",), ("gate",)),
    Stage("serve", _stage_serve, ServeRecord, ("serve", "engine"), ("promote",), still_running=_serve_still_running),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


RUN_LOG = "pipeline.log"  # what reaches the run's output outside any stage, Ray's late worker lines included


def pipeline_dir(cfg: DraftlineConfig) -> Path:
    return cfg.data_path("pipeline", cfg.name)


def stage_key(cfg: DraftlineConfig, stage: Stage, outputs: dict[str, StageRecord]) -> str:
    dumped = cfg.model_dump(mode="json")
    upstream = {name: outputs[name].to_dict() if name in outputs else None for name in stage.upstream}
    derived = stage.derived(cfg)
    # Without derived settings the key is what it was before they existed: a finished run is not redone.
    return stable_hash({s: dumped[s] for s in stage.sections}, upstream, *([derived] if derived else []))[:16]


def read_stage_outputs(stage: Stage, record: dict, key: str, record_path: Path) -> Optional[StageRecord]:
    """The outputs in a stage's record file when they were made from these inputs (`key`), else None; RecordError
    (naming the stage, field and file) when they do not match the stage's record type."""
    if record.get("key") != key:
        return None
    return stage.record.from_dict(record.get("outputs"), record_path)


def write_stage_record(record_path: Path, key: str, outputs: StageRecord, seconds: float) -> None:
    atomic_write_json(record_path, {"key": key, "outputs": outputs.to_dict(), "seconds": seconds,
                                    "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})


def _outputs_exist(outputs: StageRecord, stage: Stage) -> bool:
    out = outputs.to_dict()
    # None: a stage with nothing to keep (extract in online mode).
    return all(p in out and (out[p] is None or str(out[p]).startswith(("s3://", "gs://")) or Path(out[p]).exists())
               for p in stage.output_paths)


def plan(cfg: DraftlineConfig, from_stage: str | None = None, until: str | None = None) -> list[str]:
    names = [s.name for s in STAGES if s.applies(cfg)]
    for flag, stage in (("--from", from_stage), ("--until", until)):
        if stage is not None and stage not in names:
            raise ConfigError(f"{flag} {stage!r}: not a stage of this config; choose one of {', '.join(names)}")
    if until is not None:
        names = names[: names.index(until) + 1]
    if from_stage is not None and from_stage not in names:
        raise ConfigError(f"--from {from_stage!r} comes after --until {until!r}")
    return names


def relative_data_dir_in_ray_job(cfg: DraftlineConfig) -> str | None:
    """A relative local data_dir inside `ray job submit --working-dir` lands in Ray's temporary copy of the code."""
    if not ray_job_runtime_env().get("working_dir"):
        return None
    if os.path.isabs(os.path.expanduser(cfg.data_dir)):
        return None
    return (
        f"data_dir {cfg.data_dir!r} is relative, and this Ray job runs in Ray's temporary copy of its working dir: "
        f"outputs, checkpoints and the MLflow registry would go to {cfg.data_path()} and be deleted with the "
        f"session. Pass data_dir=/absolute/path (on a cluster: a filesystem every node mounts) after the config."
    )


def run_pipeline(cfg: DraftlineConfig, from_stage: str | None = None, keep_serving: bool = False,
                 until: str | None = None, start_command: str = "draftline serve --config CONFIG") -> dict:
    """Run (or skip) every stage; returns {stage: {"status", "seconds", "outputs"}}.

    The serve stage's entry also says what is true once the run ends ("serving": see serving.liveness), with
    `start_command` as the way to serve when nothing will be.
    """
    from rich.console import Console

    console = Console()
    warning = relative_data_dir_in_ray_job(cfg)
    if warning:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    names = plan(cfg, from_stage, until)
    root = pipeline_dir(cfg)
    write_resolved(cfg, root)
    # Between stages too only draftline's lines reach the terminal: Ray forwards a worker's last lines after its
    # stage has returned, the last of them as it shuts down. What no stage log takes goes to the run's own log.
    ray_ends = contextlib.nullcontext() if keep_serving else local_ray_stopped_at_the_end()
    with stage_log(root / "logs" / RUN_LOG, set()), ray_ends:
        ctx = Context(cfg=cfg, keep_serving=keep_serving)
        summary = _run_stages(ctx, names, from_stage, root, console)
        if "serve" in summary:
            summary["serve"]["serving"] = serving_at_exit(cfg, ctx.record(ServeRecord), keep_serving, start_command)
        atomic_write_json(root / "summary.json", summary)
        write_report(cfg, summary, root)
        if "serve" in summary:
            # Plain print: rich would wrap the command at the console width and read `[...]` in overrides as markup.
            print(f"endpoint: {serving_line(summary['serve']['serving'])}", flush=True)
    return summary


def _run_stages(ctx: Context, names: list[str], from_stage: str | None, root: Path, console) -> dict[str, dict]:
    """Run or skip each stage in `names`, each with its output in its stage log; -> the run's summary."""
    from rich.markup import escape

    cfg = ctx.cfg
    summary: dict[str, dict] = {}
    forced = False
    shown: set[str] = set()  # lines the terminal has shown in this run (draftline.stagelog)
    for stage in STAGES:
        if stage.name not in names:
            continue
        forced = forced or stage.name == from_stage
        key = stage_key(cfg, stage, ctx.outputs)
        record_path = root / "stages" / f"{stage.name}.json"
        record = read_json(record_path) if record_path.exists() else {}
        recorded = None if forced else read_stage_outputs(stage, record, key, record_path)
        done = recorded is not None and _outputs_exist(recorded, stage)
        gone = stage.still_running(ctx, recorded) if done and stage.still_running else None
        if gone:
            console.print(f"[bold]{stage.name}[/bold]: runs again (done at {record.get('finished_at')}, "
                          f"but {escape(gone)})")
        if done and not gone:
            ctx.outputs[stage.name] = recorded
            summary[stage.name] = {"status": "skipped", "seconds": 0.0, "outputs": recorded.to_dict()}
            console.print(f"[bold]{stage.name}[/bold]: skipped (inputs unchanged since {record.get('finished_at')})")
            continue
        console.rule(f"[bold]{stage.name}")
        started = time.monotonic()
        with stage_log(root / "logs" / f"{stage.name}.log", shown):
            outputs = stage.run(ctx)
        seconds = time.monotonic() - started
        if not isinstance(outputs, stage.record):
            raise TypeError(f"stage {stage.name} returned {type(outputs).__name__}, not its {stage.record.__name__}")
        ctx.outputs[stage.name] = outputs
        write_stage_record(record_path, key, outputs, seconds)
        summary[stage.name] = {"status": "ran", "seconds": seconds, "outputs": outputs.to_dict()}
        console.print(f"[bold]{stage.name}[/bold]: done in {seconds:.1f} s")
    return summary
