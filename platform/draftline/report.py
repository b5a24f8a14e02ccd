"""The pipeline's final report: a table printed and written as Markdown, and PNG plots logged to MLflow.

Reads the stage records (`pipeline.run_pipeline` summary), the training run's metric history and, where the run had
a promote stage, the registry's champion as the run ends.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from draftline.config import DraftlineConfig
from draftline.drafter.ttt import est_accept_len
from draftline.registry import CHAMPION, alias_version_number
from draftline.tracking import mlflow_client


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def serving_line(state: dict) -> str:
    """What is true about the endpoint once the run ends (pipeline: serving.liveness.serving_at_exit)."""
    if state["serving"]:
        lasts = "until this process stops (Ctrl-C)" if state.get("local_cluster") else "and goes on after this run"
        return (f"yes: {state['url']}/v1 serves {state['registered_model']} version {state['model_version']} "
                f"from Ray cluster {state['ray_address']}, {lasts}")
    return f"no: {state['reason']}; to keep it up run `{state['start_command']}`"


def champion_text(promote: dict, champion: Optional[str]) -> str:
    """The registry's champion once the run ends (`champion`: its version, None without one), and what the promote
    stage did with this run's version."""
    now = f"v{champion}" if champion else "none"
    if promote.get("promoted"):
        return now if champion == str(promote.get("version")) else f"{now} (this run promoted v{promote.get('version')})"
    return f"{now} (v{promote.get('version')} not promoted: it failed the gate)"


def report_rows(summary: dict[str, dict], model_name: str, served_steps: int,
                champion: Optional[str] = None) -> list[tuple[str, str]]:
    """The report's rows; `champion` is the registry's champion version now (None: no champion)."""
    out = {name: s.get("outputs", {}) for name, s in summary.items()}
    rows: list[tuple[str, str]] = []
    boot = out.get("bootstrap")
    if boot:
        rows.append(("target held-out perplexity (uniform)", f"{_fmt(boot.get('heldout_perplexity'), 1)} ({boot.get('uniform_perplexity')})"))
    train = out.get("train")
    if train:
        val = train.get("metrics", {})
        acc = [val[f"val_acc_{k}"] for k in range(len(val)) if f"val_acc_{k}" in val]
        rows.append(("registered version", f"{model_name} v{train.get('model_version')} (best step {train.get('best_step')})"))
        rows.append(("val acc per position", " ".join(_fmt(a) for a in acc) or "-"))
        rows.append((f"est accept length (val, {len(acc)} steps)", _fmt(val.get("val_est_accept_len"))))
        if acc:
            # The same formula cut at the served chain length, to compare with the measured accept length.
            rows.append((f"est accept length at served num_steps={served_steps}", _fmt(est_accept_len(acc[:served_steps]))))
    gate = out.get("gate")
    if gate:
        bench = gate.get("bench", {})
        rows.append(("measured accept length", _fmt(bench.get("accept_length"))))
        rows.append(("speedup vs target-only", _fmt(bench.get("speedup")) + "x" if bench.get("speedup") else "-"))
        rows.append(("output tokens/s (spec / target-only)", f"{_fmt(bench.get('tokens_per_s'), 1)} / {_fmt(bench.get('baseline_tokens_per_s'), 1)}"))
        rows.append(("TTFT p50 / ITL p50 / ITL p99 (ms)", f"{_fmt(bench.get('ttft_p50_ms'), 1)} / {_fmt(bench.get('itl_p50_ms'), 1)} / {_fmt(bench.get('itl_p99_ms'), 1)}"))
        rows.append(("lossless (greedy)", _fmt(bench.get("lossless"))))
        verdict = "passed" if gate.get("passed") else "failed: " + "; ".join(gate.get("reasons", []))
        rows.append(("gate verdict", verdict))
    promote = out.get("promote")
    if promote:
        rows.append(("champion", champion_text(promote, champion)))
    serve = summary.get("serve")
    if serve:
        if serve["status"] == "ran":
            rows.append(("served completion", repr(serve["outputs"].get("completion"))[:120]))
        rows.append(("serving", serving_line(serve["serving"])))
    rows.append(("stages", ", ".join(f"{n}: {s['status']} {s['seconds']:.0f}s" for n, s in summary.items())))
    return rows


def _plots(cfg: DraftlineConfig, summary: dict[str, dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    train = summary.get("train", {}).get("outputs", {})
    run_id = train.get("run_id")
    if run_id:
        client = mlflow_client(cfg)
        keys = sorted(k for k in client.get_run(run_id).data.metrics if k.startswith(("acc_", "loss_", "val_acc_")))
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
        for key in keys:
            history = client.get_metric_history(run_id, key)
            steps = [m.step for m in history]
            values = [m.value for m in history]
            (ax_loss if key.startswith("loss_") else ax_acc).plot(steps, values, label=key)
        ax_loss.set(title="train loss_k", xlabel="step")
        ax_acc.set(title="acc_k (train and val)", xlabel="step", ylim=(0, 1))
        ax_loss.legend(fontsize=7)
        ax_acc.legend(fontsize=6, ncol=2)
        path = out_dir / "training_curves.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    accept_lengths = summary.get("gate", {}).get("outputs", {}).get("bench", {}).get("per_request_accept_lengths")
    if accept_lengths:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        ax.hist(accept_lengths, bins=20, color="tab:blue")
        ax.set(title="accept length per request (bench)", xlabel="tokens per verify step", ylabel="requests")
        path = out_dir / "accept_length_hist.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if run_id and written:
        client = mlflow_client(cfg)
        for path in written:
            client.log_artifact(run_id, str(path), artifact_path="report")
    return written


def write_report(cfg: DraftlineConfig, summary: dict[str, dict], out_dir: Path) -> Path:
    from rich.console import Console
    from rich.table import Table

    champion = alias_version_number(cfg, CHAMPION) if "promote" in summary else None
    rows = report_rows(summary, cfg.registered_model_name, cfg.engine.speculative.num_steps, champion)
    table = Table(title=f"draftline report: {cfg.name}")
    table.add_column("what")
    table.add_column("value")
    for what, value in rows:
        table.add_row(what, value)
    # Logs and CI are not terminals: give the table room instead of rich's 80-column default.
    Console(width=None if sys.stdout.isatty() else 140).print(table)
    plots = _plots(cfg, summary, out_dir)
    lines = [f"# draftline report: {cfg.name}", "", "| what | value |", "|---|---|"]
    lines += [f"| {what} | {value.replace('|', '/')} |" for what, value in rows]
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"report: {path}" + (f"; plots: {', '.join(p.name for p in plots)} (also in MLflow)" if plots else ""))
    return path
