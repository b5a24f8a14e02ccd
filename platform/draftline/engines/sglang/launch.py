"""The SGLang launch command for `engine.sglang` and `engine.speculative`, checked by the preflight before anyone
runs it (SGLangEngine, `draftline sglang-command`)."""

from __future__ import annotations

from pathlib import Path

from draftline.config import DraftlineConfig
from draftline.engines.sglang.args import flag_table_for
from draftline.engines.sglang.preflight import PreflightError, has_errors, preflight


# engine.sglang field -> the option it is written as, in every spelling releases have had; the first one the
# configured release's flag table has is emitted (0.5.20 split --cuda-graph-max-bs into -decode / -prefill, and
# argparse then rejects the old name as an ambiguous prefix).
CONFIG_OPTIONS: dict[str, tuple[str, ...]] = {
    "mem_fraction_static": ("--mem-fraction-static",),
    "attention_backend": ("--attention-backend",),
    "page_size": ("--page-size",),
    "cuda_graph_max_bs": ("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode"),
    "dtype": ("--dtype",),
}


def build_launch_argv(
    cfg: DraftlineConfig,
    model_path: str | Path,
    draft_model_path: str | Path | None,
    *,
    python: str | None = None,
) -> list[str]:
    """The exact SGLang launch command for `cfg.engine`, checked by the preflight before it is returned.

    Raises `PreflightError` (with every finding) when the generated command has an error; warnings are
    allowed, since SGLang starts with them. `python` overrides `cfg.engine.sglang.python`.
    """
    sglang = cfg.engine.sglang
    spec = cfg.engine.speculative
    argv = [python or sglang.python, "-m", "sglang.launch_server", "--model-path", str(model_path)]
    if spec.algorithm:
        argv += ["--speculative-algorithm", spec.algorithm]
        if draft_model_path is not None:
            argv += ["--speculative-draft-model-path", str(draft_model_path)]
        argv += [
            "--speculative-num-steps", str(spec.num_steps),
            "--speculative-eagle-topk", str(spec.eagle_topk),
            "--speculative-num-draft-tokens", str(spec.num_draft_tokens),
        ]  # fmt: skip
    argv += ["--host", sglang.host, "--port", str(sglang.port), "--tp-size", str(sglang.tp_size)]
    table = flag_table_for(sglang.version)
    for field_name, spellings in CONFIG_OPTIONS.items():
        value = getattr(sglang, field_name)
        if value is None:
            continue
        option = next((o for o in spellings if o in table.flags), None)
        if option is None:
            raise ValueError(
                f"engine.sglang.{field_name}: SGLang {sglang.version} has no option for it (looked for "
                f"{', '.join(spellings)} in {table.path.name}); unset it or pick another engine.sglang.version"
            )
        argv += [option, str(value)]
    argv += list(sglang.extra_args)
    findings = preflight(argv, sglang.version)
    if has_errors(findings):
        raise PreflightError(findings, argv)
    return argv
