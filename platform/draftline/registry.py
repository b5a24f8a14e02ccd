"""Model registry aliases: resolve `champion`, promote a gated version, roll back to `previous`.

Rules (docs/serving.md, "Rollout on promotion"):
- `promote(version)` only accepts a version tagged `gate=passed` (written by `draftline gate`) whose files verify
  (`verify_export`); it moves `champion` to it and `previous` to the old champion.
- `rollback()` moves `champion` back to `previous` and removes `previous` (a second rollback needs a new promotion,
  so two rollbacks never swap back and forth).
This module only moves aliases. Rolling a running Serve app first, and moving the alias only once it has rolled,
is draftline.release (the `promote` / `rollback` commands), which sits above both registry and serving.
Serving resolves `models:/<name>@champion` through `resolve_alias`, which returns a local export directory
(downloading the artifacts into `<data_dir>/cache/models/<name>/<version>-<source hash>/` when the source is not local).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote, urlparse

from draftline.config import DraftlineConfig, SpeculativeConfig
from draftline.drafter.export import META_FILE, WEIGHTS_FILE
from draftline.tracking import (
    BENCH_BEST_TAG,
    DRIFT_DETAIL_TAG,
    DRIFT_TAG,
    DRIFT_YES,
    GATE_FAILED,
    GATE_PASSED,
    GATE_REASONS_TAG,
    GATE_RUN_TAG,
    GATE_TAG,
    REFRESH_JOB_TAG,
    mlflow_client,
)
from draftline.utils import sha256_file, stable_hash

CHAMPION = "champion"
PREVIOUS = "previous"


class RegistryError(RuntimeError):
    """A registry operation that cannot be done, phrased for the user."""


class PromotionRefused(RegistryError):
    pass


@dataclass
class ResolvedVersion:
    name: str
    version: str
    export_dir: Path
    tags: dict[str, str] = field(default_factory=dict)
    source: str = ""
    run_id: str = ""  # the MLflow run that produced it (the training run)


def _missing(err: Exception) -> bool:
    return getattr(err, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def _alias_version(client: Any, name: str, alias: str) -> Optional[Any]:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as err:
        if _missing(err):
            return None
        raise


def _local_path(source: str) -> Optional[Path]:
    parsed = urlparse(source)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "":
        return Path(source)
    return None


def export_dir_of(cfg: DraftlineConfig, name: str, version: str, source: str) -> Path:
    """A local directory with the version's files: the source itself when local, else a download cache."""
    local = _local_path(source)
    if local is not None:
        if not local.is_dir():
            raise RegistryError(f"model {name} version {version}: its source {source} is not a directory on this machine")
        return local
    # Keyed by the source too: a recreated registry can reuse a name and version number for other files.
    cache_dir = cfg.data_path("cache", "models", name, f"{version}-{stable_hash(source)[:12]}")
    marker = cache_dir / ".complete"
    if marker.exists():
        return cache_dir / "export"
    from mlflow.artifacts import download_artifacts

    # Download beside the final place, then rename: a reader never sees a partial export.
    for leftover in (cache_dir / ".download", cache_dir / "export"):
        shutil.rmtree(leftover, ignore_errors=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    downloaded = Path(download_artifacts(artifact_uri=source, dst_path=str(cache_dir / ".download")))
    downloaded.replace(cache_dir / "export")
    marker.touch()
    return cache_dir / "export"


def get_version(cfg: DraftlineConfig, version: str | int, download: bool = True) -> ResolvedVersion:
    from mlflow.exceptions import MlflowException

    client = mlflow_client(cfg)
    name = cfg.registered_model_name
    try:
        mv = client.get_model_version(name, str(version))
    except MlflowException as err:
        if _missing(err):
            raise RegistryError(
                f"model {name} has no version {version} in {cfg.mlflow_tracking_uri_shown}; list versions with the MLflow UI "
                "or train one (`draftline train`)"
            ) from None
        raise
    return _resolved(cfg, mv, download)


def _resolved(cfg: DraftlineConfig, mv: Any, download: bool) -> ResolvedVersion:
    export_dir = export_dir_of(cfg, mv.name, mv.version, mv.source) if download else Path(mv.source)
    return ResolvedVersion(mv.name, str(mv.version), export_dir, dict(mv.tags or {}), mv.source, mv.run_id or "")


def trained_dataset_dir(cfg: DraftlineConfig, version: ResolvedVersion) -> Optional[Path]:
    """The prepared dataset a version was trained on (its training run's `dataset_hash` tag), if it is still in
    data_dir; None for a version with no such run or tag (registered by hand) or whose dataset is gone."""
    if not version.run_id:
        return None
    dataset_hash = mlflow_client(cfg).get_run(version.run_id).data.tags.get("dataset_hash")
    if not dataset_hash:
        return None
    dataset_dir = cfg.data_path("datasets", dataset_hash)
    return dataset_dir if (dataset_dir / "manifest.json").is_file() else None


def resolve_alias(cfg: DraftlineConfig, alias: str = CHAMPION, download: bool = True) -> ResolvedVersion:
    """The version an alias points at, with a local export directory."""
    client = mlflow_client(cfg)
    name = cfg.registered_model_name
    mv = _alias_version(client, name, alias)
    if mv is None:
        raise RegistryError(
            f"model {name} has no alias {alias!r} in {cfg.mlflow_tracking_uri_shown}; "
            f"gate a version (`draftline gate`) and promote it (`draftline promote --version N`)"
        )
    return _resolved(cfg, mv, download)


def alias_version_number(cfg: DraftlineConfig, alias: str = CHAMPION) -> Optional[str]:
    """The version number an alias points at, or None (cheap: no download; for watchers)."""
    mv = _alias_version(mlflow_client(cfg), cfg.registered_model_name, alias)
    return None if mv is None else str(mv.version)


def measured_speculative(resolved: ResolvedVersion, concurrency: int, base: SpeculativeConfig) -> Optional[SpeculativeConfig]:
    """The speculative settings `draftline bench --sweep` measured fastest for this version: its entry for the highest
    benched concurrency not above `concurrency` (else the lowest benched one); None when no sweep was stored."""
    stored = resolved.tags.get(BENCH_BEST_TAG)
    if not stored:
        return None
    best = {int(level): entry for level, entry in json.loads(stored).items()}
    if not best:
        return None
    level = max([lv for lv in best if lv <= concurrency], default=min(best))
    entry = best[level]
    return SpeculativeConfig(algorithm=base.algorithm, num_steps=entry["num_steps"], eagle_topk=entry["eagle_topk"],
                             num_draft_tokens=entry["num_draft_tokens"])


def gate_accept_length(cfg: DraftlineConfig, version: str, concurrency: int) -> Optional[float]:
    """The accept length `draftline gate` measured for a version (the `accept_length` metric of the run its
    gate_run_id tag names, one step per benched concurrency): the entry for the highest concurrency not above
    `concurrency`, else the lowest. None when the version was never gated or the gate measured none."""
    client = mlflow_client(cfg)
    run_id = client.get_model_version(cfg.registered_model_name, version).tags.get(GATE_RUN_TAG)
    if not run_id:
        return None
    by_level = {int(m.step): float(m.value) for m in client.get_metric_history(run_id, "accept_length")}
    if not by_level:
        return None
    return by_level[max([lv for lv in by_level if lv <= concurrency], default=min(by_level))]


def mark_drift(cfg: DraftlineConfig, version: str, detail: dict) -> None:
    """Tag a version `drift=yes` with what was measured (`drift_detail`, JSON)."""
    client = mlflow_client(cfg)
    # The detail first: whoever sees drift=yes (two separate writes) finds what was measured beside it.
    client.set_model_version_tag(cfg.registered_model_name, version, DRIFT_DETAIL_TAG, json.dumps(detail, sort_keys=True))
    client.set_model_version_tag(cfg.registered_model_name, version, DRIFT_TAG, DRIFT_YES)


def refresh_job_of(cfg: DraftlineConfig, version: str) -> Optional[str]:
    """The submission id of the refresh job a drift of this version started (its `refresh_job` tag), else None."""
    return mlflow_client(cfg).get_model_version(cfg.registered_model_name, version).tags.get(REFRESH_JOB_TAG)


def mark_refresh_job(cfg: DraftlineConfig, version: str, submission_id: str) -> None:
    mlflow_client(cfg).set_model_version_tag(cfg.registered_model_name, version, REFRESH_JOB_TAG, submission_id)


def latest_version(cfg: DraftlineConfig) -> str:
    client = mlflow_client(cfg)
    name = cfg.registered_model_name
    versions = client.search_model_versions(f"name='{name}'")
    if not versions:
        raise RegistryError(f"model {name} has no versions in {cfg.mlflow_tracking_uri_shown}; train one first (`draftline train`)")
    return str(max(int(mv.version) for mv in versions))


def verify_export(resolved: ResolvedVersion) -> None:
    """Check a version's files where they are read: present, parseable, the weights complete and, where the export
    recorded it, their sha256. Raises RegistryError naming the file and the fix."""
    import json

    where = f"model {resolved.name} version {resolved.version} ({resolved.export_dir})"
    fix = "register a fresh export of that run (`draftline export` then `draftline train` registers it) and gate it"
    meta: dict = {}
    for name in ("config.json", META_FILE):
        path = resolved.export_dir / name
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise RegistryError(f"{where}: {name} is missing or unreadable ({err}); {fix}") from None
        if name == META_FILE:
            meta = loaded
    weights = resolved.export_dir / WEIGHTS_FILE
    try:
        size = weights.stat().st_size
        with open(weights, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_len)) if 0 < header_len < size else None
    except (OSError, ValueError) as err:
        raise RegistryError(f"{where}: {WEIGHTS_FILE} is missing or unreadable ({err}); {fix}") from None
    data_end = max((t["data_offsets"][1] for k, t in (header or {}).items() if k != "__metadata__"), default=-1)
    if header is None or size != 8 + header_len + data_end:
        raise RegistryError(f"{where}: {WEIGHTS_FILE} is truncated or garbled ({size} bytes); {fix}")
    recorded = meta.get("weights_sha256")
    if recorded and sha256_file(weights) != recorded:
        raise RegistryError(f"{where}: {WEIGHTS_FILE} is corrupt (sha256 differs from {META_FILE}); {fix}")


def promotion_candidate(cfg: DraftlineConfig, version: str | int) -> ResolvedVersion:
    """The version `promote` would make champion, downloaded and verified; raises PromotionRefused / RegistryError."""
    name = cfg.registered_model_name
    candidate = get_version(cfg, version, download=False)
    gate = candidate.tags.get(GATE_TAG)
    if gate != GATE_PASSED:
        if gate == GATE_FAILED:
            reasons = candidate.tags.get(GATE_REASONS_TAG, "no reasons recorded")
            raise PromotionRefused(f"refusing to promote {name} version {version}: it failed the gate ({reasons})")
        raise PromotionRefused(
            f"refusing to promote {name} version {version}: it was never gated; run `draftline gate --version {version}` first"
        )
    resolved = get_version(cfg, version)
    verify_export(resolved)
    return resolved


def rollback_candidate(cfg: DraftlineConfig) -> ResolvedVersion:
    """The version `rollback` would make champion (the `previous` alias), downloaded and verified."""
    name = cfg.registered_model_name
    if _alias_version(mlflow_client(cfg), name, PREVIOUS) is None:
        raise RegistryError(f"cannot roll back {name}: there is no '{PREVIOUS}' alias (nothing was promoted over a champion)")
    resolved = resolve_alias(cfg, PREVIOUS)
    verify_export(resolved)
    return resolved


def promote(cfg: DraftlineConfig, version: str | int) -> str:
    """Point `champion` at a gate-passed version whose files verify (old champion becomes `previous`).

    Only the aliases: rolling a running Serve app first is draftline.release's job. Returns what was done."""
    client = mlflow_client(cfg)
    name = cfg.registered_model_name
    candidate = promotion_candidate(cfg, version)
    old = _alias_version(client, name, CHAMPION)
    if old is not None and str(old.version) == candidate.version:
        return f"{name} version {candidate.version} is already the champion; nothing changed"
    if old is not None:
        client.set_registered_model_alias(name, PREVIOUS, str(old.version))
    client.set_registered_model_alias(name, CHAMPION, candidate.version)
    before = f"(previous champion {old.version} is now '{PREVIOUS}')" if old is not None else "(there was no champion)"
    return f"promoted {name} version {candidate.version} to '{CHAMPION}' {before}"


def rollback(cfg: DraftlineConfig) -> str:
    """Point `champion` back at `previous` and drop `previous`; returns what was done."""
    client = mlflow_client(cfg)
    name = cfg.registered_model_name
    previous = rollback_candidate(cfg)
    current = _alias_version(client, name, CHAMPION)
    client.set_registered_model_alias(name, CHAMPION, previous.version)
    client.delete_registered_model_alias(name, PREVIOUS)
    was = f"from version {current.version} " if current is not None else ""
    return f"rolled back {name} '{CHAMPION}' {was}to version {previous.version}; alias '{PREVIOUS}' removed"


def restore_aliases(cfg: DraftlineConfig, champion: Optional[str], previous: Optional[str]) -> None:
    """Put `champion` and `previous` back as they were (None: absent); undoes a promotion or rollback."""
    client = mlflow_client(cfg)
    name = cfg.registered_model_name
    for alias, version in ((CHAMPION, champion), (PREVIOUS, previous)):
        if version is None:
            if _alias_version(client, name, alias) is not None:
                client.delete_registered_model_alias(name, alias)
        else:
            client.set_registered_model_alias(name, alias, version)
