"""benchmarks/refresh.py's redaction hook (`serve.traffic.redact=refresh_redact:unmeasured_only`), in a module of its
own so the capture replica imports only this."""

from __future__ import annotations

from typing import Optional

MEASURE_PREFIX = "measure-"  # segment tags of measurement requests: answered and measured, never stored


def unmeasured_only(record: dict) -> Optional[dict]:
    """Measurement requests are answered but never stored, so never trained on."""
    return None if (record.get("segment") or "").startswith(MEASURE_PREFIX) else record
