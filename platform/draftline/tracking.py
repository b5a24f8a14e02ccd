"""MLflow setup and model-version registration.

One tracking store per data dir (default `sqlite:///<data_dir>/mlflow.db`, artifacts under `<data_dir>/mlruns`),
one experiment (`tracking.experiment`) and one registered model per target (`draftline-<target.name>`).

Versions are created with `MlflowClient.create_model_version(source=<artifact URI>)` rather than
`mlflow.register_model("runs:/...")`: in MLflow 3 the latter looks for a *logged model* and fails on a plain
artifact directory such as a drafter export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from draftline.config import DraftlineConfig
from draftline.utils import environment_restored

# Model-version tags written by the gate and read by promotion.
GATE_TAG = "gate"  # "passed" | "failed"; absent = never gated
GATE_REASONS_TAG = "gate_reasons"
GATE_RUN_TAG = "gate_run_id"
GATE_PASSED = "passed"
GATE_FAILED = "failed"
BENCH_BEST_TAG = "bench_best_config"  # JSON written by `draftline bench --sweep`
DRIFT_TAG = "drift"  # "yes" once serving's live accept length fell below the gate's (serving/drift.py)
DRIFT_DETAIL_TAG = "drift_detail"  # JSON: live and gate accept length, window, margin, when
DRIFT_YES = "yes"
REFRESH_JOB_TAG = "refresh_job"  # the Ray job submission id of the refresh the drift started (serving/refresh_job.py)
DRAFTER_ARTIFACT_PATH = "drafter"  # a version's source: <run artifacts>/drafter, the export directory


def _ensure_sqlite_parent(tracking_uri: str) -> None:
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix):
        Path(tracking_uri[len(prefix) :]).parent.mkdir(parents=True, exist_ok=True)


def setup_mlflow(cfg: DraftlineConfig) -> str:
    """Point MLflow (tracking and registry) at the config's store and select the experiment; returns its id.

    The experiment is created with `cfg.mlflow_artifact_location` on first use; an existing experiment keeps
    the artifact location it was created with.
    """
    import mlflow

    tracking_uri = cfg.mlflow_tracking_uri
    _ensure_sqlite_parent(tracking_uri)
    with environment_restored(*MLFLOW_ENVIRONMENT):
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(tracking_uri)
        client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        experiment = client.get_experiment_by_name(cfg.tracking.experiment)
        if experiment is None:
            experiment_id = client.create_experiment(cfg.tracking.experiment, artifact_location=cfg.mlflow_artifact_location)
        else:
            experiment_id = experiment.experiment_id
        mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


# MLflow 3's set_tracking_uri / set_registry_uri / set_experiment also write these to os.environ (for subprocesses).
# Left there, MLFLOW_TRACKING_URI would outrank the *next* config's own data_dir store (config.mlflow_tracking_uri)
# in this process and in every process it starts: a second config in one process (benchmarks/online.py's offline
# then online run, a test after another) would read and write the first one's store. MLflow's in-process state
# keeps the URIs; the environment stays what the user set.
MLFLOW_ENVIRONMENT = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_ID")


def mlflow_client(cfg: DraftlineConfig):
    """A client bound to the config's store (calls `setup_mlflow` so the experiment exists)."""
    import mlflow

    setup_mlflow(cfg)
    return mlflow.MlflowClient(tracking_uri=cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri)


def ensure_registered_model(cfg: DraftlineConfig, client: Any = None) -> str:
    from mlflow.exceptions import MlflowException

    client = client or mlflow_client(cfg)
    name = cfg.registered_model_name
    try:
        client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        client.create_registered_model(name, description=f"EAGLE-3 drafters for target {cfg.target.name}")
    return name


def register_version(
    cfg: DraftlineConfig, run_id: str, artifact_path: str, tags: Optional[dict[str, Any]] = None
) -> str:
    """Register `<run artifacts>/<artifact_path>` (a drafter export) as a new version; returns the version number.

    Tag values are stored as strings (MLflow tags are strings).
    """
    client = mlflow_client(cfg)
    name = ensure_registered_model(cfg, client)
    run = client.get_run(run_id)
    source = f"{run.info.artifact_uri.rstrip('/')}/{artifact_path.strip('/')}"
    version = client.create_model_version(
        name, source=source, run_id=run_id, tags={key: str(value) for key, value in (tags or {}).items()}
    )
    return str(version.version)


def register_export(
    cfg: DraftlineConfig, run_id: str, export_dir: str | Path, tags: Optional[dict[str, Any]] = None
) -> str:
    """Log a drafter export directory as the run's `drafter` artifact and register it as a new version (the train
    stage's last step); returns the version number."""
    mlflow_client(cfg).log_artifacts(run_id, str(export_dir), artifact_path=DRAFTER_ARTIFACT_PATH)
    return register_version(cfg, run_id, DRAFTER_ARTIFACT_PATH, tags=tags)
