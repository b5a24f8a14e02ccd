"""SGLang engine support: launch-argument generation and the launch preflight (see docs/sglang-preflight.md)."""

from draftline.engines.sglang.launch import build_launch_argv
from draftline.engines.sglang.preflight import Finding, PreflightError, format_findings, has_errors, preflight

__all__ = ["build_launch_argv", "preflight", "Finding", "PreflightError", "format_findings", "has_errors"]
